"""WorkerHost: the body of one Ray actor, i.e. one rank's process of a worker group.

The driver creates one host per rank, asks rank 0 for an address, has every host join the
torch.distributed group, then places one or more role objects (`Worker` subclasses) in each host.
Driver calls arrive as `call(role, method, args, kwargs)`.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

from rlframe.single_controller.dispatch import RankInfo
from rlframe.single_controller.worker import WorkerContext, build_role


class WorkerHost:
    def __init__(self, *, group: str, rank: int, world_size: int, num_threads: int, env: dict[str, str]):
        os.environ.update(env)
        import importlib

        import torch

        # Modules that register user algorithms (estimators, losses) must be imported in every
        # worker process too, since the losses are looked up by name there.
        for module in filter(None, os.environ.get("RLFRAME_IMPORTS", "").split(",")):
            importlib.import_module(module)

        self.num_threads = max(1, num_threads)
        torch.set_num_threads(self.num_threads)
        self._thread = threading.local()  # per-thread setup of the compiled call path
        self._held_answers: dict = {}  # call number -> its object-store answer the driver may still fetch
        self.group, self.rank, self.world_size = group, rank, world_size
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.roles: dict[str, object] = {}

    def address(self) -> tuple[str, int]:
        """This node's IP and a port that is free now, for rank 0 to serve the rendezvous."""
        import ray

        from rlframe.utils.ports import free_port

        return ray.util.get_node_ip_address(), free_port("")

    def init_distributed(self, *, master_addr: str, master_port: int, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        bind_gloo_to_node_interface()  # NCCL runs build gloo groups too (weight channel, vLLM's CPU group)
        os.environ.update(
            {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(self.rank),
             "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0"}
        )
        if self.backend == "nccl":
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        dist.init_process_group(
            self.backend, rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=timeout_s)
        )

    def add_role(self, role: str, cls: type, args: tuple, kwargs: dict) -> dict[str, RankInfo]:
        ctx = WorkerContext(group=self.group, role=role, rank=self.rank, world_size=self.world_size,
                            local_rank=0, backend=self.backend)
        self.roles[role] = build_role(cls, ctx, args, kwargs)
        return self.roles[role].rank_infos()

    def call(self, role: str, method: str, args: tuple, kwargs: dict, collect: bool = True, stamp: bool = False):
        """(output, seconds inside the method). Arguments the driver put in the object store once for
        several ranks arrive as ObjectRefs and are fetched here; `collect=False` (a rank whose output
        the dispatch mode does not gather, e.g. a tp peer) returns None instead of the output.
        `stamp` (the run is traced, rlframe/utils/trace.py): (output, seconds, start, end, spans)."""
        import time

        if stamp:
            return self._stamped_call(role, method, args, kwargs, collect)
        args, kwargs = _resolve_refs(args, kwargs)
        t0 = time.perf_counter()
        out = getattr(self.roles[role], method)(*args, **kwargs)
        return (out if collect else None), time.perf_counter() - t0

    def _stamped_call(self, role: str, method: str, args: tuple, kwargs: dict, collect: bool):
        """The call with this rank's wall-clock start and end, and the (name, start, end) of the phases
        timed inside it (the fetch of its object-store arguments among them)."""
        import time

        from rlframe.utils import trace

        with trace.collecting() as spans:
            start = time.time()
            resolved = _resolve_refs(args, kwargs)
            if resolved[0] is not args or resolved[1] is not kwargs:
                spans.append(("fetch_args", start, time.time()))
            t0 = time.perf_counter()
            out = getattr(self.roles[role], method)(*resolved[0], **resolved[1])
            seconds = time.perf_counter() - t0
            end = time.time()
        return (out if collect else None), seconds, start, end, spans

    def call_packed(self, payload):
        """The compiled call path's entry (rlframe/single_controller/compiled.py): `payload` is None where
        this rank is not called, else (pickled call, its ObjectRefs). It runs on Ray's system thread
        of this actor, not the main one; torch's thread count is per thread and is set here once."""
        if payload is None:
            return None
        from rlframe.single_controller import compiled

        if not getattr(self._thread, "ready", False):
            import torch

            torch.set_num_threads(self.num_threads)
            self._thread.ready = True
        data, refs, settled, call = payload
        compiled.release(self._held_answers, settled)  # calls whose answers the driver no longer needs
        role, method, args, kwargs, collect, *stamp = compiled.decode(data, refs)
        return compiled.answer(self.call(role, method, args, kwargs, collect, *stamp), self._held_answers, call)

    def pid(self) -> int:
        return os.getpid()

    def held_answers(self) -> int:
        """How many object-store answers of compiled calls this rank still holds for the driver."""
        return len(self._held_answers)

    def shutdown(self) -> None:
        import torch.distributed as dist

        for obj in self.roles.values():
            close = getattr(obj, "close", None)
            if callable(close):
                close()
        if dist.is_initialized():
            dist.destroy_process_group()


# Settings of the collective libraries that must reach every rank on every node (interface names,
# timeouts, debug levels); the driver's values are forwarded to the workers.
COMM_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "CUDA_DEVICE_MAX_CONNECTIONS")

# Set by the driver when the cluster has nodes at more than one address: gloo must then bind the
# interface that holds this node's Ray address (see bind_gloo_to_node_interface).
MULTI_HOST_ENV = "RLFRAME_MULTI_HOST"


def bind_gloo_to_node_interface() -> str | None:
    """On a cluster of several hosts, point gloo at the interface of this node's Ray address unless
    GLOO_SOCKET_IFNAME is set already (the user's, forwarded from the driver).

    Gloo otherwise binds the address this host's name resolves to, and many hosts resolve their
    name to a loopback address (Debian's 127.0.1.1 in /etc/hosts) or to nothing (gloo then falls back
    to 127.0.0.1): every rank announces an address no other host can reach and the group's start-up
    times out with "connection refused, remote=[127.0.0.1]". Ray's node address is the one the
    cluster reaches this host at, so its interface is right. One host alone keeps gloo's default.
    Returns the interface set (None: left as it was)."""
    import ray

    from rlframe.utils.net import interface_of, is_loopback

    if os.environ.get(MULTI_HOST_ENV) != "1" or os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    ip = ray.util.get_node_ip_address()
    iface = None if is_loopback(ip) else interface_of(ip)
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    return iface


def _resolve_refs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    import ray

    refs = [v for v in (*args, *kwargs.values()) if isinstance(v, ray.ObjectRef)]
    if not refs:
        return args, kwargs
    values = dict(zip(refs, ray.get(refs)))
    return (tuple(values.get(a, a) if isinstance(a, ray.ObjectRef) else a for a in args),
            {k: values.get(v, v) if isinstance(v, ray.ObjectRef) else v for k, v in kwargs.items()})
