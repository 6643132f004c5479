"""FSDP2's all-gather and reduce-scatter through shared memory, for CPU ranks on one host.

On CPU, FSDP2's collectives go through gloo, that is TCP over the loopback device: on the 12m
preset (47 MB of fp32 parameters, 2 ranks) one all-gather of the whole model takes 41 ms and one
reduce-scatter of its gradients 52 ms, while copying those bytes in memory takes a few. Ranks of
one host can share a buffer instead (a file in /dev/shm mapped by every rank):

- all-gather: each rank copies its shard into its slot, a barrier, each rank copies the whole
  buffer into its output, a barrier (so no rank overwrites a slot another is still reading);
- reduce-scatter: each rank copies its whole input into its slot, a barrier, each rank adds up
  its own range of every slot, in rank order, into its output, a barrier.

The barriers are gloo's (the process group's), so ordering and failure behave as before; only the
bulk bytes move through memory. The sums are those gloo computes for two ranks bit for bit (a + b,
and AVG as the sum divided by the world size); beyond two ranks the order of the additions may
differ from gloo's in the last bits (tests/workers/engines/fsdp/test_shm_comm.py).

`install(model, group)` sets it on every FSDP module of `model` when it applies: CPU, gloo, more
than one rank, every rank on this host, and room in /dev/shm (else FSDP keeps gloo and nothing
changes). Operations other than SUM and AVG go to gloo.
"""

from __future__ import annotations

import os
import socket
import uuid

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

SHM_DIR = "/dev/shm"
# Never take more than this fraction of /dev/shm's free space (Ray's object store lives there too).
MAX_SHARE_OF_FREE = 0.25


class SharedSegment:
    """A /dev/shm file of `nbytes` that every rank of `group` maps (collective to create)."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int):
        rank = dist.get_rank(group)
        name = [f"rlframe-fsdp-{uuid.uuid4().hex}" if rank == 0 else None]
        dist.broadcast_object_list(name, group_src=0, group=group)
        path = os.path.join(SHM_DIR, name[0])
        if rank == 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # no room: an error here, not SIGBUS at first touch
            finally:
                os.close(fd)
        dist.barrier(group=group)
        try:
            self.bytes = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            dist.barrier(group=group)
            if rank == 0:
                os.unlink(path)  # the mappings stay; the name goes, so nothing is left behind
        self.nbytes = nbytes

    def view(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.bytes[: numel * dtype.itemsize].view(dtype)


class SharedMemoryComm(AllGather, ReduceScatter):
    """FSDP2's custom all-gather and reduce-scatter (one object serves both, for one group)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.segment: SharedSegment | None = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self.segment is None or self.segment.nbytes < nbytes:  # same sizes on every rank: collective
            self.segment = None
            self.segment = SharedSegment(self.group, nbytes)
        return self.segment.view(numel, dtype)

    def _check_group(self, group) -> None:
        if group is not self.group and dist.get_process_group_ranks(group) != dist.get_process_group_ranks(self.group):
            raise ValueError("SharedMemoryComm was called with another process group than it was built for")

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=None, async_op: bool = False):
        self._check_group(group)
        if op is None:  # FSDP's all-gather: the input is this rank's shard
            return self.all_gather(output_tensor, input_tensor)
        return self.reduce_scatter(output_tensor, input_tensor, op)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        n = shard.numel()
        if output.numel() != n * self.world:
            raise ValueError(f"all-gather output has {output.numel()} elements, expected {n} x {self.world}")
        buf = self._buffer(n * self.world, shard.dtype)
        buf[self.rank * n: (self.rank + 1) * n].copy_(shard.reshape(-1))
        dist.barrier(group=self.group)
        output.view(-1).copy_(buf)
        dist.barrier(group=self.group)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, op) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output, full, op=op, group=self.group)
        total, n = full.numel(), output.numel()
        if total != n * self.world:
            raise ValueError(f"reduce-scatter input has {total} elements, expected {n} x {self.world}")
        buf = self._buffer(total * self.world, full.dtype)
        buf[self.rank * total: (self.rank + 1) * total].copy_(full.reshape(-1))
        dist.barrier(group=self.group)
        slots = buf.view(self.world, self.world, n)[:, self.rank]  # every rank's copy of my range
        out = output.view(-1)
        torch.add(slots[0], slots[1], out=out)
        for r in range(2, self.world):
            out.add_(slots[r])
        if op == dist.ReduceOp.AVG:
            out.div_(self.world)
        dist.barrier(group=self.group)
        return None


def _one_host(group: dist.ProcessGroup) -> bool:
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def _room_for(nbytes: int) -> bool:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return nbytes <= MAX_SHARE_OF_FREE * st.f_bavail * st.f_frsize


def install(model: torch.nn.Module, group: dist.ProcessGroup) -> bool:
    """Route the FSDP collectives of `model` over `group` through shared memory if that applies
    (see the module docstring); True if it was installed. Collective over `group`."""
    if dist.get_backend(group) != "gloo" or dist.get_world_size(group) < 2:
        return False
    world = dist.get_world_size(group)
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # the segment holds every rank's copy of the largest reduce-scatter input (a module's padded
    # fp32 gradients): world x world x (the module's largest local shard)
    largest = max((sum(p.to_local().numel() for p in _own_params(m)) for m in fsdp_modules), default=0)
    needed = 4 * largest * world * world
    ok = torch.tensor([int(_one_host(group) and _room_for(needed))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank decides the same
    if not ok.item():
        return False
    comm = SharedMemoryComm(group)
    for m in fsdp_modules:
        m.set_custom_all_gather(comm)
        m.set_custom_reduce_scatter(comm)
    return True


def _own_params(module: FSDPModule):
    """The parameters this FSDP module manages (not those of FSDP modules inside it)."""
    state = module._get_fsdp_state()
    return [fp.sharded_param for group in state._fsdp_param_groups for fp in group.fsdp_params]
