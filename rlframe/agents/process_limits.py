"""Process trees and hard limits for the tool sandbox (rlframe/agents/sandbox.py), Linux's /proc and
prctl: find and SIGKILL every process below one, drop CAP_SYS_RESOURCE, lower a process's address
space, CPU time and core dumps.

    kill_descendants(os.getpid(), exclude=keep, reap=True)   # until none is left
    set_limits(memory_mb=512, cpu_s=2.0)                     # soft = hard, lowered only
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import time
from functools import lru_cache

try:
    import resource
except ImportError:  # not on this platform: no limits but the wall clock
    resource = None

_PR_CAPBSET_DROP = 24
_CAP_SYS_RESOURCE = 24


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (zombies left out), from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != b"Z":
            out[int(name)] = int(fields[1])
    return out


def descendants(root: int, exclude: frozenset[int] = frozenset()) -> set[int]:
    """The live processes below `root` in the process tree, without the subtrees of `exclude`."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [p for p in children.get(root, []) if p not in exclude]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def reap_children() -> bool:
    """Collect this process's finished children; True when one is still running."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def kill_descendants(root: int, *, exclude: frozenset[int] = frozenset(), reap: bool = False,
                     timeout_s: float = 5.0) -> set[int]:
    """SIGKILL every process below `root` (but the subtrees of `exclude`), again and again until none
    is left, so that one forked meanwhile goes too; `reap`: root is this process, which collects
    them. Returns the processes still alive at `timeout_s` (stuck in the kernel); normally empty."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = descendants(root, exclude)
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if reap:
            reap_children()
        time.sleep(0.001)  # the kills take effect; orphans are handed to root (a subreaper)


@lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def prctl(option: int, arg: int) -> bool:
    try:
        return _libc().prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_resource_capability() -> None:
    """Drop CAP_SYS_RESOURCE (raising hard limits) from this process and whatever it executes: a
    process of root keeps it otherwise. Linux; a no-op where the process does not hold it."""
    prctl(_PR_CAPBSET_DROP, _CAP_SYS_RESOURCE)  # what execve() could give back (needs CAP_SETPCAP)
    try:
        libc = _libc()
        header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
        if libc.capget(ctypes.byref(header), data) != 0:
            return
        keep = ~(1 << _CAP_SYS_RESOURCE) & 0xFFFFFFFF
        data[0].effective &= keep
        data[0].permitted &= keep
        data[0].inheritable &= keep
        libc.capset(ctypes.byref(header), data)
    except (OSError, AttributeError):
        pass


def _address_space() -> int | None:
    """Bytes of address space this process maps now (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def set_limits(memory_mb: int, cpu_s: float) -> None:
    """Hard limits (soft = hard, lowered only) for this process and those it starts: address space
    `memory_mb` MiB above what it maps now, `cpu_s` seconds of CPU (SIGXCPU, SIGKILL one second
    later), no core dumps."""
    if resource is None:
        return

    def lower(which: int, soft: int, hard: int) -> None:
        cap = resource.getrlimit(which)[1]
        if cap != resource.RLIM_INFINITY:
            soft, hard = min(soft, cap), min(hard, cap)
        resource.setrlimit(which, (soft, hard))

    base = _address_space()
    if base is not None:
        limit = base + memory_mb * 2**20
        lower(resource.RLIMIT_AS, limit, limit)
    cpu = max(1, math.ceil(cpu_s))
    lower(resource.RLIMIT_CPU, cpu, cpu + 1)
    lower(resource.RLIMIT_CORE, 0, 0)
