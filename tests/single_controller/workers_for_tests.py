"""Worker classes used by the controller tests (importable by Ray's worker processes)."""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlframe.single_controller import Dispatch, Mesh, Worker, register


class EchoWorker(Worker):
    def __init__(self, tag="echo", mesh=None):
        self.tag = tag
        self.calls = 0
        self.seen = []
        if mesh is not None:
            self.set_mesh(Mesh.of(**mesh))
        self.set_mesh(Mesh.of(dp=self.world_size), name="flat")  # a second layout, e.g. rollout

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def whoami(self, x):
        self.calls += 1
        return (self.rank, self.world_size, self.tag, x)

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def square(self, x, *, offset=0):
        self.calls += 1
        return x * x + offset

    @register(dispatch=Dispatch.RANK_ZERO)
    def only_rank_zero(self, x):
        self.calls += 1
        return ("rank-zero", self.rank, x)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def call_count(self):
        return self.calls

    @register(dispatch=Dispatch.DP_COMPUTE)
    def double(self, data, *, scale=2):
        """Records the chunk it got and returns the values scaled, tagged with this rank."""
        self.seen.append(data.batch["x"].tolist())
        out = data.select(batch_keys=["x"])
        out.batch["x"] = out.batch["x"] * scale
        out.batch["rank"] = torch.full((len(data),), self.rank)
        return out

    @register(dispatch=Dispatch.DP_COMPUTE)
    def timed_double(self, data):
        """`double` (not recorded) with its work in a timed phase: a span inside the call when traced.
        It takes longer than compiled.SHORT_CALL_S, so by default it stays on the plain path."""
        from rlframe.utils.timing import timed

        with timed({}, "work"):
            time.sleep(0.06)
            out = data.select(batch_keys=["x"])
            out.batch["x"] = out.batch["x"] * 2
        return out

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="flat")
    def tag_rank(self, data):
        out = data.select(batch_keys=["x"])
        out.batch["rank"] = torch.full((len(data),), self.rank)
        return out

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def seen_chunks(self):
        return self.seen

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self):
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def node_id(self):
        import ray

        return ray.get_runtime_context().get_node_id()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def wait_for_file(self, path, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while not Path(path).exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    @register(dispatch=Dispatch.RANK_ZERO)
    def touch(self, path):
        Path(path).write_text("x")
        return True


class FaultyWorker(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank):
        if self.rank == rank:
            raise ValueError(f"bad input on rank {self.rank}")
        return self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def die_on(self, rank):
        if self.rank == rank:
            os._exit(3)
        return self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def late_barrier(self, late_rank, seconds):
        """A barrier that rank `late_rank` reaches `seconds` late (a long write on one rank)."""
        if self.rank == late_rank:
            time.sleep(seconds)
        dist.barrier()
        return self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL, blocking=False)
    def later(self, x):
        return x + self.rank


def check_rank_one_raises(group) -> None:
    """A FaultyWorker group's `fail_on(1)` raises WorkerCallError naming the group, method, rank and error."""
    import pytest

    from rlframe.single_controller import WorkerCallError

    with pytest.raises(WorkerCallError) as err:
        group.fail_on(1, timeout=60)
    msg = str(err.value)
    assert f"worker group {group.name!r}" in msg and "method 'fail_on'" in msg and "rank 1" in msg
    assert "ValueError: bad input on rank 1" in msg


class KeepingWorker(Worker):
    """Keeps what it is sent and records the order of calls (the compiled call path's tests)."""

    def __init__(self):
        self.kept, self.order = [], []

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def keep(self, data, value):
        """Keeps `data` (a DataProto) and answers numpy and tensor outputs filled with `value`."""
        import numpy as np

        self.kept.append(data)
        return np.full(50_000, float(value)), torch.full((1000,), float(value)), data

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def kept_sums(self):
        return [float(d.batch["x"].sum()) for d in self.kept]

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def big_answer(self, n):
        return torch.full((n,), float(self.rank))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def record(self, tag, delay_s=0.0):
        time.sleep(delay_s)
        self.order.append(tag)
        return list(self.order)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def num_threads(self):
        return torch.get_num_threads()


class HostFactsWorker(Worker):
    """What a rank of a multi-host group sees (tests/controller/test_multihost.py)."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def facts(self):
        import socket

        from rlframe.single_controller.worker_group import communication_env

        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return {"hostname": socket.gethostname(), "master_addr": os.environ.get("MASTER_ADDR"),
                "comm_env": communication_env(),
                "all_reduce": t.item()}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def shares_memory(self):
        """Whether FSDP's shared-memory collectives take this group (every rank maps rank 0's segment)."""
        from rlframe.workers.engines.fsdp.shm_comm import SharedMemoryComm

        return SharedMemoryComm(dist.group.WORLD, nbytes=1 << 20).segment is not None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def probe_storage(self, directory):
        """The checkpoint writer's shared-storage probe on `directory`: None, or the error it raised."""
        from rlframe.workers.engines.checkpoint import SharedStorageError, check_shared_storage

        try:
            check_shared_storage(directory, is_first=self.rank == 0, group=None)
            return None
        except SharedStorageError as err:
            return str(err)
