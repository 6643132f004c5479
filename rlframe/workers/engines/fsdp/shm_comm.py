"""FSDP2's all-gather and reduce-scatter through shared memory, for CPU ranks on one host.

On CPU, FSDP2's collectives go through gloo, that is TCP over the loopback device: on the 12m
preset (47 MB of fp32 parameters, 2 ranks) one all-gather of the whole model takes 41 ms and one
reduce-scatter of its gradients 52 ms, while copying those bytes in memory takes a few. Ranks of
one host can share a buffer instead (a file in /dev/shm mapped by every rank):

- all-gather: each rank copies its shard into its slot, a barrier, each rank copies the whole
  buffer into its output, a barrier (so no rank overwrites a slot another is still reading);
- reduce-scatter: each rank copies its whole input into its slots (one per destination rank), a
  barrier, each rank adds up its own range from every rank's slot, in rank order, into its output,
  a barrier.
Collectives larger than the segment (at most SEGMENT_BYTES per dp group) go in chunks.

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
# The most one dp group maps; larger collectives go through it in chunks (12m, 2 ranks: 95 MB of
# reduce-scatter slots, two chunks).
SEGMENT_BYTES = 64 << 20


class SharedSegment:
    """A /dev/shm file of `nbytes` that every rank of `group` maps (collective to create)."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int):
        rank = dist.get_rank(group)
        sizes = [None] * dist.get_world_size(group)
        dist.all_gather_object(sizes, (f"rlframe-fsdp-{uuid.uuid4().hex}", nbytes), group=group)
        if len({n for _, n in sizes}) != 1:  # every rank would chunk differently and the barriers mismatch
            raise ValueError(f"ranks asked for shared segments of different sizes {[n for _, n in sizes]}; "
                             "every rank of the group must pass the same nbytes")
        path = os.path.join(SHM_DIR, sizes[0][0])
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
    """FSDP2's custom all-gather and reduce-scatter (one object serves both, for one group), through
    one segment of `nbytes`: collectives larger than it go in chunks, two barriers each."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int = SEGMENT_BYTES):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.segment = SharedSegment(group, nbytes)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _chunk(self, dtype: torch.dtype, slots: int) -> int:
        """Elements per slot when the segment holds `slots` slots of `dtype`."""
        return max(1, self.segment.nbytes // (dtype.itemsize * slots))

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
        w, n = self.world, shard.numel()
        if output.numel() != n * w:
            raise ValueError(f"all-gather output has {output.numel()} elements, expected {n} x {w}")
        c = self._chunk(shard.dtype, w)
        buf, src, dst = self.segment.view(w * c, shard.dtype).view(w, c), shard.reshape(-1), output.view(w, n)
        for off in range(0, n, c):
            k = min(c, n - off)
            buf[self.rank, :k].copy_(src[off:off + k])
            dist.barrier(group=self.group)
            dst[:, off:off + k].copy_(buf[:, :k])
            dist.barrier(group=self.group)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, op) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output, full, op=op, group=self.group)
        w, n = self.world, output.numel()
        if full.numel() != n * w:
            raise ValueError(f"reduce-scatter input has {full.numel()} elements, expected {n} x {w}")
        c = self._chunk(full.dtype, w * w)
        # slot [src, dst]: rank src's values of rank dst's range
        buf, src, out = self.segment.view(w * w * c, full.dtype).view(w, w, c), full.view(w, n), output.view(-1)
        for off in range(0, n, c):
            k = min(c, n - off)
            buf[self.rank, :, :k].copy_(src[:, off:off + k])
            dist.barrier(group=self.group)
            mine, part = buf[:, self.rank, :k], out[off:off + k]
            torch.add(mine[0], mine[1], out=part)  # in rank order, as gloo adds two ranks
            for r in range(2, w):
                part.add_(mine[r])
            if op == dist.ReduceOp.AVG:
                part.div_(w)
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
    # enough for every rank's copy of the largest reduce-scatter input in one go (a module's fp32
    # gradients: world x world x its padded shard), at most SEGMENT_BYTES; the padded size is the
    # same on every rank (an uneven shard, such as a 1-row value head, is empty on some), and the
    # ranks take the maximum all the same: they must agree or they would chunk differently
    largest = max((sum(_padded_numel(m)) for m in fsdp_modules), default=0)
    nbytes = torch.tensor([max(1, min(SEGMENT_BYTES, 4 * largest * world * world))])
    dist.all_reduce(nbytes, op=dist.ReduceOp.MAX, group=group)
    nbytes = int(nbytes.item())
    ok = torch.tensor([int(_one_host(group) and _room_for(nbytes))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank decides the same
    if not ok.item():
        return False
    comm = SharedMemoryComm(group, nbytes)
    for m in fsdp_modules:
        m.set_custom_all_gather(comm)
        m.set_custom_reduce_scatter(comm)
    return True


def _padded_numel(module: FSDPModule):
    """The padded shard sizes of the parameters this FSDP module manages (not those of FSDP
    modules inside it): what its all-gather inputs are made of."""
    state = module._get_fsdp_state()
    return [fp.padded_sharded_param_size.numel() for group in state._fsdp_param_groups for fp in group.fsdp_params]
