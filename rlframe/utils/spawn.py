"""Run one function on N local processes joined in a gloo process group.

Used by tests and benchmarks that need real torch.distributed ranks without Ray:
`run_distributed(fn, world_size=4, args=(...))` starts `world_size` processes (forked from a
multiprocessing fork server that has imported torch once: fresh processes with the caller's
environment, without paying the imports per rank), initialises `torch.distributed` (gloo) in each, calls `fn(rank, world_size, *args)` and returns
the list of per-rank return values. Return numpy arrays or Python values, not torch tensors:
a tensor travels through shared memory that is gone once its rank exits. An exception on any rank is
re-raised in the caller with that rank's traceback; a rank that hangs fails after `timeout_s`.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, Sequence

from rlframe.utils.ports import free_port


class DistributedRunError(RuntimeError):
    """A rank raised, died or timed out inside `run_distributed`."""


_PORT_TAKEN = "port taken"
_LAUNCHES = 3  # launches on fresh ports before a taken rendezvous port is an error


def _entry(fn, rank, world_size, port, args, env, results, backend="gloo"):
    # A forked rank starts with the fork server's environment: take the caller's, as a spawned one would.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    import torch
    import torch.distributed as dist

    # Several ranks share two cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(int(env.get("RLFRAME_THREADS_PER_RANK", "1")))
    try:
        try:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        except Exception as e:
            if "EADDRINUSE" in str(e):  # the rendezvous port was taken after it was drawn: run again
                results.put((rank, _PORT_TAKEN, traceback.format_exc()))
                return
            raise
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # report every failure, including KeyboardInterrupt in a child
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks (gloo, or nccl on GPUs); return per-rank results.

    `fn` must be importable by name (a module-level function): it is pickled to the fork server.
    """
    for launch in range(_LAUNCHES):
        try:
            return _run_once(fn, world_size, tuple(args), timeout_s, dict(env or {}), backend)
        except _PortTaken as e:
            if launch == _LAUNCHES - 1:
                raise DistributedRunError(f"the rendezvous port was taken on {_LAUNCHES} launches:\n{e}") from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


_PRELOAD = ("torch", "torch.distributed", "transformers", "safetensors.torch", "megatron.core")


def _context():
    """A fork server that has imported torch, transformers and megatron-core once: each rank is a fresh
    fork of it (no state of an earlier rank), without paying those imports again (2-4 s a rank)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0])])
    return ctx


def _run_once(fn, world_size: int, args: tuple, timeout_s: float, env: dict, backend: str) -> list[Any]:
    ctx = _context()
    env = {**os.environ, **env}
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, args, env, results, backend))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(outs) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outs))
                dead = [r for r in missing if procs[r].exitcode not in (None, 0)]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise DistributedRunError(f"ranks {dead} of {world_size} died (exit codes {codes})") from None
                if time.monotonic() > deadline:
                    raise DistributedRunError(
                        f"ranks {missing} of {world_size} gave no result within {timeout_s:.0f}s "
                        "(a hang in a collective, usually because another rank took a different path)"
                    ) from None
                continue
            if ok == _PORT_TAKEN:
                for p in procs:  # the other ranks wait on a rendezvous that will not come
                    p.kill()
                raise _PortTaken(payload)
            if not ok:
                raise DistributedRunError(f"rank {rank} of {world_size} raised:\n{payload}")
            outs[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [outs[r] for r in range(world_size)]
