import socket

import pytest

from rlframe.utils import spawn
from rlframe.utils.ports import RANGE, free_ports


def test_ports_are_distinct_outside_the_ephemeral_range_and_bindable():
    ports = free_ports(8) + free_ports(8)
    assert len(set(ports)) == 16
    assert all(RANGE[0] <= p < RANGE[1] for p in ports)
    lo, _ = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert max(ports) < lo
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def _rank(rank, world):
    return rank * 10 + world


def test_run_distributed_launches_again_when_its_rendezvous_port_is_taken(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        drawn = iter([taken.getsockname()[1]])
        real = spawn.free_port
        monkeypatch.setattr(spawn, "free_port", lambda: next(drawn, None) or real())
        assert spawn.run_distributed(_rank, world_size=2, timeout_s=60) == [2, 12]


def test_a_port_taken_on_every_launch_is_an_error(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(spawn, "free_port", lambda: taken.getsockname()[1])
        monkeypatch.setattr(spawn, "_LAUNCHES", 2)
        with pytest.raises(spawn.DistributedRunError, match="rendezvous port was taken on 2 launches"):
            spawn.run_distributed(_rank, world_size=2, timeout_s=60)
