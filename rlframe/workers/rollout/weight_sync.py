"""Weight sync into a rollout engine: which slice each generation-TP rank needs, and assembling it.

Dataflow (one training step -> generation):

  resharding executor --consumer(pieces)--> ShardAssembler --complete params--> engine loader
  pieces: [(hf_name, Box, tensor)]           per-parameter buffer           in-place copy (default)
  (a bucket; any split of the needed box)   filled until the box is covered  or vLLM's layer-wise reload

`vllm_tp_box` says which Box of every HF parameter vLLM's tensor-parallel rank reads. It is
Megatron's split (`rlframe.resharding.layout.hf_tp_split_dim`) except in two places where vLLM
differs, and the generation layout must follow vLLM there:
- vocab-parallel embed_tokens / lm_head: vLLM pads the vocabulary to a multiple of 64 before
  splitting it, so with V=100 and tp=2 rank 0 reads rows [0, 64) and rank 1 rows [64, 100)
  (Megatron's torch.chunk split would be [0, 50) / [50, 100));
- k/v projections when tp > num_kv_heads: vLLM replicates kv heads, rank r reads head
  r // (tp / num_kv_heads).

Memory: a parameter is held from its first piece until its box is complete, and vLLM's layer-wise
reload (kernel_format=False) keeps the tensors of a layer until all of that layer's weights arrived; with pieces ordered
by layer (the planner's order) that is about one decoder layer. For vLLM's checkpoint-format
loader at TP > 1 the buffer has the parameter's full shape (the loader narrows it to the rank's
slice itself) but only the rank's box is written: the rest is `torch.empty`, whose untouched pages
are never faulted in. For dim-0 splits (q/k/v/gate/up, vocabulary) resident memory is therefore the
rank's slice; for dim-1 splits (o_proj, down_proj) every row is written, so those buffers become
resident in full (still one layer's worth at a time).

Measured, not assumed (WeightSyncStats): `peak_held_bytes` is the most the receiving side holds at
a bucket boundary: the assembler's pending buffers plus the completed tensors it handed to the
engine's loader that are still referenced (vLLM's layer-wise reload keeps them until the layer is
complete; weak references tell). `peak_rss_extra_bytes` is the process's peak resident memory during
the update above its resident memory at the start (Linux: VmHWM reset through /proc/self/clear_refs),
so it also sees transient copies inside the loader, and on a colocated rank the sender's bucket
arena too; `peak_device_extra_bytes` is the same for CUDA allocations. -1: not measurable here.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping

import torch

from rlframe.resharding.box import Box, chunk_box
from rlframe.resharding.layout import hf_tp_split_dim

Piece = tuple[str, Box, torch.Tensor]
VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


def vllm_tp_box(name: str, shape, *, tp_rank: int, tp_size: int, num_kv_heads: int,
                head_dim: int, vocab_padding: int = VOCAB_PADDING) -> Box:
    """The Box of HF parameter `name` (global `shape`) that vLLM's TP rank `tp_rank` of `tp_size` reads."""
    shape = tuple(int(s) for s in shape)
    dim = hf_tp_split_dim(name)
    if tp_size == 1 or dim is None:
        return Box.full(shape)
    module = name.split(".")[-2]
    if module in ("embed_tokens", "lm_head"):
        vocab = shape[0]
        padded = -(-vocab // vocab_padding) * vocab_padding
        per_rank = padded // tp_size
        lo, hi = min(tp_rank * per_rank, vocab), min((tp_rank + 1) * per_rank, vocab)
        return Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:])
    if module in ("k_proj", "v_proj") and tp_size > num_kv_heads:
        if tp_size % num_kv_heads:
            raise ValueError(f"tp({tp_size}) must be a multiple of num_kv_heads({num_kv_heads}) when larger")
        head = tp_rank // (tp_size // num_kv_heads)
        return Box((head * head_dim,) + (0,) * (len(shape) - 1), (head_dim,) + shape[1:])
    if shape[dim] % tp_size:
        raise ValueError(f"{name}: dim {dim} of {shape} is not divisible by tp({tp_size}); vLLM splits it evenly")
    return chunk_box(shape, dim=dim, index=tp_rank, parts=tp_size)


def vllm_needed_boxes(shapes: Mapping[str, tuple[int, ...]], *, tp_rank: int, tp_size: int,
                      num_kv_heads: int, head_dim: int) -> dict[str, Box]:
    """`vllm_tp_box` for every parameter of `shapes` ({hf_name: global shape})."""
    return {n: vllm_tp_box(n, s, tp_rank=tp_rank, tp_size=tp_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
            for n, s in shapes.items()}


@dataclass
class WeightSyncStats:
    """What one rank's engine did in one weight update (measured)."""

    bytes_received: int = 0      # payload of the pieces handed in
    bytes_resident: int = 0      # bytes of the needed boxes written (what the rank really holds)
    bytes_loaded_view: int = 0   # bytes of the tensors handed to the loader (full shape at TP > 1)
    peak_pending_bytes: int = 0  # largest resident buffer total held between pieces
    peak_held_bytes: int = 0     # pending buffers + tensors the loader still references, at bucket boundaries
    peak_rss_extra_bytes: int = -1     # peak resident memory of the process during the update - at its start
    peak_device_extra_bytes: int = -1  # the same for CUDA allocations (-1 off GPU)
    num_params: int = 0
    num_buckets: int = 0
    time_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class MemoryWatch:
    """Peak memory of this process during a block, above its level at the start (host and CUDA)."""

    def __init__(self):
        try:  # "5" resets the peak resident set size (VmHWM) to the current one (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self._rss0 = _status_bytes("VmRSS")
        except OSError:
            self._rss0 = None
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
            self._dev0 = torch.cuda.memory_allocated()

    def peak_extra(self) -> tuple[int, int]:
        """(host bytes, CUDA bytes) above the start; -1 where not measurable."""
        hwm = _status_bytes("VmHWM") if self._rss0 is not None else None
        host = max(0, hwm - self._rss0) if hwm is not None else -1
        dev = max(0, torch.cuda.max_memory_allocated() - self._dev0) if self._cuda else -1
        return host, dev


class ShardAssembler:
    """Collect `(name, Box, tensor)` pieces until each parameter's needed box is covered.

    needed: {name: Box} this rank must receive; full_shapes: {name: global shape}.
    full_shape_buffers: hand out full-shape tensors with only the needed box written (vLLM's
        checkpoint-format loaders at TP > 1); otherwise tensors shaped like the needed box.
    fill: value for the unwritten part of full-shape buffers; None leaves it uninitialised
        (no memory touched). Tests use NaN to prove the loader never reads it.
    Pieces may overlap the needed box only partly (the overlap is taken) and may repeat no element.
    """

    def __init__(self, *, needed: Mapping[str, Box], full_shapes: Mapping[str, tuple[int, ...]],
                 full_shape_buffers: bool, fill: float | None = None):
        self.needed = dict(needed)
        self.full_shapes = {n: tuple(int(x) for x in s) for n, s in full_shapes.items()}
        self.full_shape_buffers = full_shape_buffers
        self.fill = fill
        self._buffers: dict[str, torch.Tensor] = {}
        self._covered: dict[str, int] = {}
        self.done: set[str] = set()
        self.stats = WeightSyncStats()
        self._handed: list[tuple[weakref.ref, int]] = []  # tensors given to the loader, and their bytes
        self._memory = MemoryWatch()

    def _sample_held(self) -> None:
        self._handed = [(ref, n) for ref, n in self._handed if ref() is not None]
        # Resident bytes: the needed box of each buffer (a full-shape buffer's other pages stay untouched).
        pending = sum(self.needed[n].numel * b.element_size() for n, b in self._buffers.items())
        held = pending + sum(n for _, n in self._handed)
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, held)

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            box = self.needed[name]
            shape = self.full_shapes[name] if self.full_shape_buffers else box.sizes
            if self.fill is None:
                buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            else:
                buf = torch.full(shape, self.fill, dtype=like.dtype, device=like.device)
            self._buffers[name], self._covered[name] = buf, 0
        return buf

    def add(self, pieces: Iterable[Piece]) -> list[tuple[str, Box, torch.Tensor]]:
        """Copy the pieces in; return the parameters completed by them as (name, needed_box, tensor)."""
        completed = []
        self._sample_held()  # what the loader kept of the previous bucket
        self.stats.num_buckets += 1
        for name, box, tensor in pieces:
            if name not in self.needed:
                raise ValueError(f"weight update sent {name!r}, which this rollout model does not have")
            if tuple(tensor.shape) != tuple(box.sizes):
                raise ValueError(f"{name}: piece tensor {tuple(tensor.shape)} does not match its box {box}")
            need = self.needed[name]
            self.stats.bytes_received += tensor.numel() * tensor.element_size()
            common = need.intersect(box) if not need.empty else None
            if common is None or name in self.done:
                continue  # outside this rank's slice (e.g. a full tensor at TP > 1), or a resend
            buf = self._buffer(name, tensor)
            dst = common if self.full_shape_buffers else common.relative_to(need)
            buf[dst.slices()] = tensor[common.relative_to(box).slices()]
            self._covered[name] += common.numel
            assert self._covered[name] <= need.numel, f"{name}: pieces overlap ({self._covered[name]} > {need.numel})"
            if self._covered[name] == need.numel:
                completed.append((name, need, self._buffers.pop(name)))
                self._covered.pop(name)
                self.done.add(name)
        pending = sum(self.needed[n].numel * b.element_size() for n, b in self._buffers.items())
        self.stats.peak_pending_bytes = max(self.stats.peak_pending_bytes, pending)
        for name, need, buf in completed:
            self._handed.append((weakref.ref(buf), need.numel * buf.element_size()))
            self.stats.num_params += 1
            self.stats.bytes_resident += need.numel * buf.element_size()
            self.stats.bytes_loaded_view += buf.numel() * buf.element_size()
        self._sample_held()  # the completed tensors are all alive now, about to be loaded
        return completed

    def missing(self) -> list[str]:
        """Parameters whose needed box is not (fully) covered yet."""
        return [n for n, b in self.needed.items() if n not in self.done and not b.empty]

    def check_complete(self) -> None:
        """Raise unless every needed box arrived; record the update's peak memory (call it last)."""
        self._sample_held()
        self.stats.peak_rss_extra_bytes, self.stats.peak_device_extra_bytes = self._memory.peak_extra()
        missing = self.missing()
        if missing:
            partial = {n: f"{self._covered.get(n, 0)}/{self.needed[n].numel}" for n in missing[:5]}
            raise ValueError(
                f"weight update ended with {len(missing)} parameters not fully received (elements received/"
                f"needed: {partial}); the sender's generation layout must cover vLLM's slice per rank "
                "(see rlframe.workers.rollout.weight_sync.vllm_tp_box)"
            )


def full_state_dict_pieces(state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
    """Turn a plain HF state dict (or (name, tensor) iterator) into one-piece buckets of full boxes."""
    items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    for name, tensor in items:
        yield [(name, Box.full(tensor.shape), tensor)]


@contextmanager
def timed(stats: WeightSyncStats):
    """Adds the wall time of the `with` block to `stats.time_s`."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stats.time_s += time.perf_counter() - t0
