"""Ports for rendezvous and local services, drawn outside the kernel's ephemeral range.

A port found free by binding to port 0 comes from the ephemeral range (32768-60999 on Linux), the
same range the kernel hands to every outgoing connection and every `bind(0)` of other processes
(Ray's, gloo's pair sockets): between the check and the real `listen` another socket can take it,
and the rendezvous fails with EADDRINUSE. Ports here come from 30000-32767 instead, below that
range and above the worker ports of Ray (10002-19999) and of `rlframe.jobs.cluster` (20000-29999),
so only another explicit choice from this same range can race for one.
"""

from __future__ import annotations

import collections
import random
import socket

RANGE = (30000, 32768)  # [lo, hi)
_recent: collections.deque[int] = collections.deque(maxlen=256)  # handed out by this process, maybe not bound yet


def free_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports of `RANGE` that bind on `host` right now (held open together so they differ).

    Falls back to ephemeral ports for whatever `RANGE` cannot supply (every port in it taken).
    The last 256 ports this process handed out are skipped: a caller may not have bound them yet.
    """
    socks: list[socket.socket] = []
    try:
        candidates = random.sample(range(*RANGE), RANGE[1] - RANGE[0])
        for port in candidates:
            if len(socks) == n:
                break
            if port in _recent:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        ports = [s.getsockname()[1] for s in socks]
        _recent.extend(ports)
        return ports
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port of `RANGE` that binds on `host` right now."""
    return free_ports(1, host)[0]
