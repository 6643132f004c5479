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

One host is proven, not assumed from the hostname (two containers may share a hostname and each
have a private /dev/shm): rank 0 creates the segment and writes a random nonce into it, the other
ranks open it without creating it and read the nonce, and an all-gather over gloo of what each rank
saw decides on every rank alike. If any rank did not see the nonce, every rank keeps gloo's
collectives and one line says why. The segment's name is removed by every surviving rank as soon as
set-up ends, mapped or failed (a rank killed during it leaves nothing in /dev/shm while another rank
lives). The directory is /dev/shm, or `RLFRAME_SHM_DIR` where set (tests give one rank another).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import uuid

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

SHM_DIR = "/dev/shm"
# Overrides SHM_DIR for this process (tests give one rank a private directory).
SHM_DIR_ENV = "RLFRAME_SHM_DIR"
# Random bytes rank 0 writes at the start of a new segment: a rank that reads them maps rank 0's file.
NONCE_BYTES = 16
# Never take more than this fraction of /dev/shm's free space (Ray's object store lives there too).
MAX_SHARE_OF_FREE = 0.25
# The most one dp group maps; larger collectives go through it in chunks (12m, 2 ranks: 95 MB of
# reduce-scatter slots, two chunks).
SEGMENT_BYTES = 64 << 20


logger = logging.getLogger(__name__)


class SegmentUnavailable(RuntimeError):
    """Not every rank of the group maps the same segment (raised on every rank alike)."""


def shm_dir() -> str:
    """The directory of the segments of this process: RLFRAME_SHM_DIR, else /dev/shm."""
    return os.environ.get(SHM_DIR_ENV) or SHM_DIR


def _create_segment(path: str, nbytes: int, nonce: bytes) -> mmap.mmap:
    """Rank 0: a new file of `nbytes` (never an existing one), mapped, the nonce at its start."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # no room: an error here, not SIGBUS at first touch
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    mapping[:len(nonce)] = nonce
    return mapping


def _open_segment(path: str, nbytes: int, nonce: bytes) -> mmap.mmap:
    """Other ranks: rank 0's file, mapped; never created (a missing file is an error, not zeros)."""
    fd = os.open(path, os.O_RDWR)  # no O_CREAT: torch.from_file would create a fresh file of zeros
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise OSError(f"{path} has {size} bytes, rank 0 made {nbytes}")
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if mapping[:len(nonce)] != nonce:
        mapping.close()
        raise OSError(f"{path} does not hold rank 0's nonce (another file of the same name)")
    return mapping


def _map(path: str, nbytes: int, nonce: bytes, rank: int) -> tuple[mmap.mmap | None, str | None]:
    """This rank's mapping of the segment, or None and why not."""
    try:
        if rank == 0:
            return _create_segment(path, nbytes, nonce), None
        return _open_segment(path, nbytes, nonce), None
    except OSError as err:
        return None, f"{type(err).__name__}: {err}"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)  # the mappings stay; the name goes, so nothing is left behind
    except FileNotFoundError:  # removed by another rank, or never here (a private /dev/shm)
        pass


class SharedSegment:
    """A /dev/shm file of `nbytes` that every rank of `group` maps (collective to create); raises
    SegmentUnavailable on every rank if any rank could not map rank 0's file."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int):
        rank = dist.get_rank(group)
        offers = [None] * dist.get_world_size(group)
        dist.all_gather_object(offers, (f"rlframe-fsdp-{uuid.uuid4().hex}", os.urandom(NONCE_BYTES), nbytes),
                               group=group)
        if len({n for _, _, n in offers}) != 1:  # every rank would chunk differently and the barriers mismatch
            raise ValueError(f"ranks asked for shared segments of different sizes {[n for *_, n in offers]}; "
                             "every rank of the group must pass the same nbytes")
        name, nonce, _ = offers[0]
        path = os.path.join(shm_dir(), name)
        mapping, failed = _map_on_every_rank(group, rank, path, max(nbytes, NONCE_BYTES), nonce)
        if failed:
            raise SegmentUnavailable(_why_unshared(failed, path))
        self._mapping = mapping  # the tensor below views it; kept for its lifetime
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        self.nbytes = nbytes

    def view(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.bytes[: numel * dtype.itemsize].view(dtype)


def _map_on_every_rank(group: dist.ProcessGroup, rank: int, path: str, nbytes: int,
                       nonce: bytes) -> tuple[mmap.mmap | None, dict[int, str]]:
    """Rank 0 creates the file, then the others open it: this rank's mapping and, the same on every
    rank, why each rank that could not map it did not. Whatever happens, and whichever rank dies
    meanwhile, every surviving rank removes the name before returning or raising."""
    try:
        mapping, why = _map(path, nbytes, nonce, rank) if rank == 0 else (None, None)
        dist.barrier(group=group)  # rank 0's file exists (or rank 0 knows why not)
        if rank != 0:
            mapping, why = _map(path, nbytes, nonce, rank)
        seen = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, why, group=group)  # every rank has mapped it, or said why not
    finally:
        _unlink(path)
    return mapping, {r: w for r, w in enumerate(seen) if w is not None}


def _why_unshared(failed: dict[int, str], path: str) -> str:
    ranks = ", ".join(f"rank {r}: {w}" for r, w in sorted(failed.items()))
    return (f"not every rank maps the shared segment {os.path.basename(path)} of rank 0 ({ranks}); the "
            "ranks are on different hosts or in containers with private /dev/shm (same hostname or not). "
            "The collectives go through gloo; to share memory, give the containers one /dev/shm "
            "(e.g. docker --ipc=host)")


class SharedMemoryComm(AllGather, ReduceScatter):
    """FSDP2's custom all-gather and reduce-scatter (one object serves both, for one group), through
    one segment of `nbytes`: collectives larger than it go in chunks, two barriers each. Where not
    every rank maps the segment, `shared` is False and both go through gloo (collective to build)."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int = SEGMENT_BYTES):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        try:
            self.segment: SharedSegment | None = SharedSegment(group, nbytes)
        except SegmentUnavailable as err:
            if self.rank == 0:  # the same on every rank: one line for the group
                logger.warning("FSDP collectives keep gloo: %s", err)
            self.segment = None

    @property
    def shared(self) -> bool:
        """True where the collectives go through shared memory, False where through gloo."""
        return self.segment is not None

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
        if self.segment is None:
            return dist.all_gather_into_tensor(output, shard, group=self.group)
        c = self._chunk(shard.dtype, w)
        buf, src, dst = self.segment.view(w * c, shard.dtype).view(w, c), shard.reshape(-1), output.view(w, n)
        for off in range(0, n, c):
            k = min(c, n - off)
            buf[self.rank, :k].copy_(src[off:off + k])
            dist.barrier(group=self.group)
            dst[:, off:off + k].copy_(buf[:, :k])
            dist.barrier(group=self.group)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, op) -> None:
        if self.segment is None or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
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
        st = os.statvfs(shm_dir())
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
    if not comm.shared:  # not every rank maps the segment: FSDP keeps its own gloo collectives
        return False
    for m in fsdp_modules:
        m.set_custom_all_gather(comm)
        m.set_custom_reduce_scatter(comm)
    return True


def _padded_numel(module: FSDPModule):
    """The padded shard sizes of the parameters this FSDP module manages (not those of FSDP
    modules inside it): what its all-gather inputs are made of."""
    state = module._get_fsdp_state()
    return [fp.padded_sharded_param_size.numel() for group in state._fsdp_param_groups for fp in group.fsdp_params]
