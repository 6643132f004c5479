"""The main job across hosts that are separate network namespaces (rlframe/utils/netns_hosts.py):
each host its own network, /dev/shm and hostname, a Ray head in h0 and a worker node in the others,
the driver in h0. Root only (CI runs as root); skipped elsewhere with the reason.

- a group spanning two hosts: its rendezvous and gloo bind addresses other hosts reach, the
  collective libraries' settings reach every host, FSDP's shared memory is used within a host and
  never across, and the checkpoint storage probe passes on shared storage and refuses a directory
  one host cannot see;
- the GRPO job with fsdp dp across two hosts gives the metrics of the same layout on one host, and
  sends its collectives over the network;
- a host lost mid-step (its raylet and every process on it killed): the driver names the node and
  waits; the host comes back; the run resumes from the newest checkpoint and ends with the metrics
  of the uninterrupted run;
- the weight channel (rollout.weight_transport=auto) joins ranks on one host by shared-memory rings
  and ranks on different hosts by gloo, in one sync.

All tests share one cluster (the module's `hosts`; the host-loss test brings its host back). Each
host runs a worker zygote (tests/zygote.py) at the same path in its own /dev/shm, and every Ray job
here (and each weight-channel rank) starts its processes through it: a process forks from its own
host's server, so it has that host's network, /dev/shm and hostname, and skips re-importing torch,
vLLM and rlframe's workers (about 8 s of CPU a process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlframe.utils.netns_hosts import NetnsHosts, unavailable
from tests import zygote
from tests.measured import MEASURED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHY_NOT = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"multi-host tests: {WHY_NOT}")]

# Ray marks a lost node dead after 4 missed health checks of 0.5 s (its defaults take longer)
FAST_HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
               "RAY_health_check_failure_threshold": "4", "RAY_health_check_initial_delay_ms": "0"}
# GRPO on the demo model at temperature 0.8 with two mini-batches per step; time-based checkpoints
# only (every step, as the interval is shorter than a step), all kept
JOB = ["model.tiny_preset=demo", "data.train_batch_size=4", "data.response_length=6", "data.val_size=16",
       "rollout.temperature=0.8", "actor.mini_batch_size=8", "actor.micro_batch_size=4", "actor.dp=2",
       "algorithm.use_kl_loss=false", "ref.enabled=false", "trainer.total_steps=4", "trainer.save_every=0",
       "trainer.save_every_minutes=0.0001", "trainer.keep_checkpoints=5",
       "trainer.val_every=0", "trainer.export_hf=false", "trainer.loggers=[jsonl]", "trainer.plot=false",
       "trainer.progress_bar=false", "rollout.val_n=2", "rollout.kv_cache_bytes=33554432"]
ONE_HOST = ["resources.nodes=1", "resources.procs_per_node=2"]
TWO_HOSTS = ["resources.nodes=2", "resources.procs_per_node=1"]
# No idle Python workers prestarted when the first driver connects (rlframe's workers are actors that
# never take one), as rlframe's private Ray (controller/ray_utils.PRIVATE_RAY_SYSTEM_CONFIG)
NO_PRESTART = {"RAY_prestart_worker_first_driver": "0"}
# The zygote's socket: one path, a different file (and server) in each host's own /dev/shm
ZYGOTE_SOCK = "/dev/shm/rlframe-zygote.sock"
# A driver's environment whose job starts its workers through the zygote of their host
VIA_ZYGOTE = zygote.job_env(ZYGOTE_SOCK)


class Hosts(NetnsHosts):
    """NetnsHosts with a worker zygote (tests/zygote.py) serving inside each host."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.zygotes: list[subprocess.Popen] = []

    def start_zygote(self, i: int) -> None:
        """A server on host i (again after kill_node(i), which kills it with everything else there)."""
        self.zygotes.append(self.popen(i, [sys.executable, "-m", "tests.zygote", "serve", ZYGOTE_SOCK], cwd=REPO,
                                       env={"TOKENIZERS_PARALLELISM": "false"}))

    def wait_zygotes(self, *, timeout_s: float = 300.0) -> None:
        """Until the first server of every host listens (a client would wait for it, but not tell why it died)."""
        deadline = time.monotonic() + timeout_s
        for i, server in enumerate(self.zygotes[: self.n]):
            sock = Path(f"/proc/{self.anchors[i].pid}/root{ZYGOTE_SOCK}")  # host i's /dev/shm, seen from here
            while not sock.exists():
                assert server.poll() is None and time.monotonic() < deadline, f"h{i}'s worker zygote did not start"
                time.sleep(0.1)

    def close(self) -> None:
        super().close()  # kills every process of every host, the zygotes and their workers among them
        for server in self.zygotes:
            server.kill()
            server.wait()
        self.zygotes = []


@pytest.fixture(scope="module")
def hosts():
    with Hosts(2, cpus=3, env={**FAST_HEALTH, **NO_PRESTART, "PYTHONPATH": REPO}) as cluster:
        for i in range(cluster.n):  # their imports overlap Ray's start
            cluster.start_zygote(i)
        cluster.start_ray()
        cluster.wait_zygotes()
        yield cluster


def run(hosts: NetnsHosts, root: Path, name: str, *overrides: str):
    job = hosts.run_job("grpo_tiny", JOB + [*overrides, f"trainer.output_dir={root}", f"trainer.experiment={name}"],
                        run_dir=root / name, env=VIA_ZYGOTE)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    return job


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows}


GROUP_SCRIPT = textwrap.dedent("""
    import json, sys, ray
    from rlframe.single_controller import RayWorkerGroup, ResourcePool
    from tests.single_controller.workers_for_tests import HostFactsWorker

    ray.init(address="auto", log_to_driver=False)
    shared, hidden = sys.argv[1], sys.argv[2]
    across = RayWorkerGroup(ResourcePool(procs_per_node=[1, 1], name="across"), HostFactsWorker, name="across")
    within = RayWorkerGroup(ResourcePool(procs_per_node=[2], name="within"), HostFactsWorker, name="within")
    print(json.dumps({"facts": across.facts(), "across_shm": across.shares_memory(),
                      "within_hosts": [f["hostname"] for f in within.facts()], "within_shm": within.shares_memory(),
                      "shared": across.probe_storage(shared), "hidden": across.probe_storage(hidden)}))
""")


def test_a_group_across_hosts_binds_reachable_addresses_and_sees_its_storage(hosts, tmp_path):
    shared, hidden = tmp_path / "shared", tmp_path / "hidden"
    shared.mkdir()
    hosts.private_mount(1, hidden)  # h1 sees an empty tmpfs there, h0 the shared directory
    proc = hosts.run(0, [sys.executable, "-c", GROUP_SCRIPT, str(shared / "step.tmp"), str(hidden / "step.tmp")],
                     env={"RAY_ADDRESS": hosts.ray_address, "NCCL_DEBUG": "INFO", "GLOO_TIMEOUT_SECONDS": "300",
                          "PYTHONPATH": REPO, **VIA_ZYGOTE}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    facts = seen["facts"]
    assert sorted(f["hostname"] for f in facts) == ["h0", "h1"]
    assert [f["all_reduce"] for f in facts] == [3.0, 3.0]
    for f in facts:  # a rendezvous address the other host reaches, gloo bound to the network's interface
        assert f["master_addr"] == facts[0]["master_addr"] and f["master_addr"] in (hosts.ip(0), hosts.ip(1)), f
        assert f["comm_env"]["GLOO_SOCKET_IFNAME"] == "eth0", f
        assert f["comm_env"]["NCCL_DEBUG"] == "INFO" and f["comm_env"]["GLOO_TIMEOUT_SECONDS"] == "300", f
    assert seen["across_shm"] == [False, False]  # /dev/shm is per host: FSDP keeps gloo across hosts
    assert len(set(seen["within_hosts"])) == 1 and seen["within_shm"] == [True, True]
    assert seen["shared"] == [None, None]
    # h1 has its own (empty) directory there: the rank that is not rank 0's host misses rank 0's file
    blind = facts[1]["hostname"]
    assert all("is not on storage shared by all ranks" in e and f"on hosts ['{blind}']" in e
               for e in seen["hidden"]), seen["hidden"]


@pytest.fixture(scope="module")
def two_host_run(hosts, tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    one = run(hosts, root, "one-host", *ONE_HOST)
    two = run(hosts, root, "two-hosts", *TWO_HOSTS)
    return root, one, two


def test_fsdp_across_two_hosts_matches_one_host(two_host_run):
    root, one, two = two_host_run
    reference, spread = metrics(root / "one-host"), metrics(root / "two-hosts")
    assert sorted(spread) == [1, 2, 3, 4]
    assert spread == reference
    for run in ("one-host", "two-hosts"):  # checkpoints by time only, written by ranks on both hosts
        done = sorted(p.name for p in (root / run / "checkpoints").iterdir())
        assert done == [f"step_00000{s}" for s in (1, 2, 3, 4)], (run, done)
    # the gradients' reduce-scatter and the parameters' all-gather crossed the network
    assert two.bytes_per_step() > 20 * max(one.bytes_per_step(), 1.0), (one.bytes_per_step(), two.bytes_per_step())


def test_a_host_lost_mid_step_is_named_waited_for_and_the_run_resumes(hosts, two_host_run):
    root, _, _ = two_host_run
    name = "node-lost"
    proc = hosts.popen(0, [sys.executable, "-m", "rlframe.main", "--config-name", "grpo_tiny", *JOB, *TWO_HOSTS,
                           f"ray.address={hosts.ray_address}", f"trainer.output_dir={root}", f"trainer.experiment={name}",
                           "resources.node_wait_s=120",
                           "actor.worker_cls=tests.controller.trainers.faulty_workers:NodeLostOnceActor"],
                       env=VIA_ZYGOTE, stdout=open(root / "node-lost.out", "w"), stderr=open(root / "node-lost.err", "w"))
    marker = root / name / "node-lost-once"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), (root / "node-lost.err").read_text()[-5000:]
    lost = int(marker.read_text().strip()[1:])  # the paused rank's host: h1 (never h0, the driver's)
    killed_at = time.monotonic()
    hosts.kill_node(lost)
    hosts.start_zygote(lost)  # the host's zygote died with it; the new one imports while the driver notices the loss
    said = root / "node-lost.out"
    while "waiting up to" not in said.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    hosts.start_node(lost)  # the machine comes back while the driver waits for it
    assert proc.wait(timeout=400) == 0, (root / "node-lost.err").read_text()[-5000:]
    recovered_s = time.monotonic() - killed_at
    out = (root / "node-lost.out").read_text()
    address = hosts.ip(lost)
    assert f"died with its node {address}" in out, out[-3000:]  # rank 0 or 1: Ray picks the nodes
    assert f"lost node {address}" in out and "waiting up to 120s (resources.node_wait_s)" in out, out[-3000:]
    # paused in step 3, so the newest complete checkpoint is step 2's
    assert "the cluster has room for the run again" in out and "resumed from" in out and "step_000002" in out
    print(f"\nnode loss: killed h{lost}, back and resumed, run finished {recovered_s:.0f} s later")
    assert metrics(root / name) == metrics(root / "two-hosts")


SINK = textwrap.dedent("""
    import socket, sys
    s = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    c, _ = s.accept()
    while c.recv(1 << 20):
        pass
""")
SOURCE = textwrap.dedent("""
    import socket, sys, time
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    t0 = time.perf_counter()
    c.sendall(b"x" * (4 << 20))
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    print(time.perf_counter() - t0)
""")


def _send_4mb(hosts: NetnsHosts, port: int) -> float:
    sink = hosts.popen(1, [sys.executable, "-c", SINK, hosts.ip(1), str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "listening"  # the source connects once the sink listens
        out = hosts.run(0, [sys.executable, "-c", SOURCE, hosts.ip(1), str(port)], timeout=60, check=True)
        sink.wait(timeout=30)
    finally:
        sink.kill()
        sink.wait()
        sink.stdout.close()
    return float(out.stdout.strip())


def test_a_hosts_egress_cap_limits_what_it_sends(hosts):
    """limit_egress: 4 MiB from h0 at 100 Mbit/s take at least 0.3 s (33.6 Mbit), several times what they take
    uncapped (what benchmarks/weight_sync.py --hosts measures links with)."""
    hosts.limit_egress(0, 100)
    try:
        capped = _send_4mb(hosts, 29611)
    finally:
        hosts.limit_egress(0, None)
    free = _send_4mb(hosts, 29612)
    assert capped >= 0.3 and capped > 3 * free, (capped, free)


CHANNEL_RANK = """
import json, sys
from pathlib import Path
import torch
from rlframe.resharding.channel import P2PChannel
from rlframe.resharding.planner import plan_reshard
from tests.resharding.pairs import DIMS, full_weights, metas
from tests.resharding.test_transport import DST, SRC, _sync
rank, addr, port, result = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
channel = P2PChannel(addr=addr, port=port, rank=rank, world_size=4, timeout_s=60, transport="auto")
t = channel.transport
shm = sorted(t.by_peer) if hasattr(t, "by_peer") else []
plan = plan_reshard(metas(), src=SRC, dst=DST, num_layers=DIMS.num_layers)
exact = _sync(channel, plan, full_weights(seed=3), rank)[0]
channel._store.set(f"done/{rank}", "1")
if rank == 0:  # it holds the store until every rank is done
    channel._store.wait([f"done/{r}" for r in range(4)])
result.write_text(json.dumps({"shm": shm, "exact": exact}))
"""


def test_the_weight_channel_joins_one_hosts_ranks_by_shm_and_hosts_by_gloo(hosts, tmp_path):
    """Channel ranks 0 and 2 on h0, 1 and 3 on h1 (training dp2 = ranks 0-1, generation tp2 = ranks 2-3): auto
    gives each rank shm rings with its host's other rank only (each host has its own /dev/shm and address),
    gloo to the rest, and the sync puts exactly its slices on ranks 2 and 3. Each rank is a process its
    host's zygote forks (`python script.py ARGS` through zygote's client); it writes what it saw to a file."""
    port = 29613
    script = tmp_path / "channel_rank.py"
    script.write_text(CHANNEL_RANK)
    client = zygote.client_command(ZYGOTE_SOCK).split()
    results = [tmp_path / f"rank{rank}.json" for rank in range(4)]
    procs = [hosts.popen(rank % 2, [*client, str(script), str(rank), hosts.ip(0), str(port), str(results[rank])],
                         env={"GLOO_SOCKET_IFNAME": "eth0"},  # as the job's workers bind gloo (single_controller/host.py)
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for rank in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    got = [json.loads(r.read_text()) for r in results]
    assert [g["shm"] for g in got] == [[2], [3], [0], [1]], got
    assert all(g["exact"] for g in got), got
