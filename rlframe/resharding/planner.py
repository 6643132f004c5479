"""Transfer planning: for every destination slice, which source rank sends which bytes.

`plan_reshard(params, src=, dst=)` intersects the boxes two layouts assign to each rank:

1. For every parameter and destination rank, the destination box is cut along every source-box
   boundary into cells; each cell is either held by a source rank or not at all.
2. Cells the destination rank already holds in the source layout are reused in place (a `Transfer`
   with src == dst, zero bytes moved). Every other cell comes from one source that holds it, chosen
   as the least-loaded holder so far (dp replicas share the sending work), the nearest rank among
   equally loaded ones (so HybridFlow layouts gather inside their micro-DP groups).
3. Cells from the same source are merged back into as few boxes as possible.

By construction no byte is received twice and no byte is received that the rank already holds, so
the bytes a rank receives are the minimum for the pair of layouts. This covers HybridFlow's scheme
(`hybridflow_generation_layout`), FSDP dim-0 shards to row-parallel shards, TP ratios that do not
divide, and split placement (source and destination on different ranks).
The plan is a pure function of its inputs: every rank computes the same plan without communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Callable, Mapping

import torch

from rlframe.resharding.box import Box
from rlframe.resharding.layout import Layout


@dataclass(frozen=True)
class ParamMeta:
    """Global shape and dtype of one parameter."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class Transfer:
    """Box `box` of parameter `name` goes from global rank `src` to `dst` (src == dst: reused locally)."""

    name: str
    box: Box
    src: int
    dst: int

    @property
    def local(self) -> bool:
        return self.src == self.dst


@dataclass
class Plan:
    """All transfers of one reshard, in parameter order, plus the boxes each side holds."""

    params: dict[str, ParamMeta]
    src: Layout
    dst: Layout
    transfers: list[Transfer]
    src_boxes: dict[tuple[str, int], Box]  # (name, rank) -> box held in the source layout
    dst_boxes: dict[tuple[str, int], Box]  # (name, rank) -> box needed in the destination layout

    def nbytes(self, t: Transfer) -> int:
        return t.box.numel * self.params[t.name].itemsize

    def bytes_received(self, rank: int) -> int:
        return sum(self.nbytes(t) for t in self.transfers if t.dst == rank and not t.local)

    def bytes_sent(self, rank: int) -> int:
        return sum(self.nbytes(t) for t in self.transfers if t.src == rank and not t.local)

    def bytes_reused(self, rank: int) -> int:
        return sum(self.nbytes(t) for t in self.transfers if t.dst == rank and t.local)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src.ranks) | set(self.dst.ranks)))

    def summary(self) -> str:
        """Per-rank bytes of the plan as a markdown table (for dry runs and logs)."""
        full = sum(Box.full(m.shape).numel * m.itemsize for m in self.params.values())
        lines = [f"reshard {self.src.describe()} -> {self.dst.describe()}; model {full / 1e6:.1f} MB",
                 "| rank | received MB | sent MB | reused in place MB | received / model |", "|---|---|---|---|---|"]
        for r in self.ranks:
            got = self.bytes_received(r)
            lines.append(f"| {r} | {got / 1e6:.2f} | {self.bytes_sent(r) / 1e6:.2f} | "
                         f"{self.bytes_reused(r) / 1e6:.2f} | {got / full:.4f} |")
        return "\n".join(lines)


def param_metas(tensors: Mapping[str, object]) -> dict[str, ParamMeta]:
    """{name: ParamMeta} from full tensors (or anything with .shape and .dtype, e.g. meta tensors)."""
    return {n: ParamMeta(tuple(int(s) for s in t.shape), t.dtype) for n, t in tensors.items()}


def _cells(need: Box, holders: list[Box]) -> list[Box]:
    """Cut `need` along every boundary of `holders` (clipped to `need`) into disjoint cells."""
    axes = []
    for d, (o, s) in enumerate(zip(need.offsets, need.sizes)):
        cuts = {o, o + s}
        for h in holders:
            for c in (h.offsets[d], h.offsets[d] + h.sizes[d]):
                if o < c < o + s:
                    cuts.add(c)
        cuts = sorted(cuts)
        axes.append(list(zip(cuts[:-1], cuts[1:])))
    return [Box(tuple(lo for lo, _ in iv), tuple(hi - lo for lo, hi in iv)) for iv in product(*axes)]


def _try_merge(a: Box, b: Box) -> Box | None:
    """a and b glued together if they are adjacent along one dim and equal in all others."""
    diff = [d for d in range(len(a.offsets)) if (a.offsets[d], a.sizes[d]) != (b.offsets[d], b.sizes[d])]
    if len(diff) != 1:
        return None
    d = diff[0]
    lo, hi = (a, b) if a.offsets[d] < b.offsets[d] else (b, a)
    if lo.offsets[d] + lo.sizes[d] != hi.offsets[d]:
        return None
    sizes = list(lo.sizes)
    sizes[d] += hi.sizes[d]
    return Box(lo.offsets, tuple(sizes))


def merge_boxes(boxes: list[Box]) -> list[Box]:
    """Greedily merge adjacent boxes until no pair can be merged (order-deterministic)."""
    if len(boxes) <= 1:
        return list(boxes)
    out = list(boxes)
    merged = True
    while merged:
        merged = False
        for i in range(len(out)):
            for j in range(i + 1, len(out)):
                m = _try_merge(out[i], out[j])
                if m is not None:
                    out[i] = m
                    del out[j]
                    merged = True
                    break
            if merged:
                break
    return sorted(out, key=lambda b: b.offsets)


def _candidates(need: Box, groups: dict[Box, list[int]], name: str) -> list[tuple[Box, list[int]]]:
    """Cells of `need` with the source ranks holding each (depends on the box, not on the rank)."""
    touching = [b for b in groups if b.intersect(need) is not None]
    out = []
    for cell in _cells(need, touching):
        cands = [s for b in touching if b.contains(cell) for s in groups[b]]
        if not cands:
            raise ValueError(
                f"no source rank holds {cell} of {name!r}, which a destination rank needs; "
                "the source layout must cover every parameter completely"
            )
        out.append((cell, cands))
    return out


def _plan_one(name: str, rank: int, cells: list[tuple[Box, list[int]]], own: Box | None,
              load: dict[int, int], itemsize: int) -> list[Transfer]:
    """Transfers that complete one destination box on `rank`: reuse what it holds, else the least-loaded holder."""
    by_src: dict[int, list[Box]] = {}
    for cell, cands in cells:
        if own is not None and own.contains(cell):
            by_src.setdefault(rank, []).append(cell)
            continue
        # Least-loaded holder spreads the work over replicas; among equals the nearest rank
        # (same node, and HybridFlow's micro-DP group for its strided layouts).
        src = min(cands, key=lambda s: (load[s], abs(s - rank), s))
        load[src] += cell.numel * itemsize
        by_src.setdefault(src, []).append(cell)
    return [Transfer(name, b, s, rank) for s in sorted(by_src) for b in merge_boxes(by_src[s])]


BoxFn = Callable[[str, tuple, int], "Box | None"]  # (name, global shape, global rank) -> box held/needed


def plan_reshard(params: Mapping[str, ParamMeta], *, src: Layout, dst: Layout,
                 num_layers: int | None = None, src_box: BoxFn | None = None,
                 dst_box: BoxFn | None = None) -> Plan:
    """Plan moving every parameter from layout `src` to layout `dst` (global ranks on both sides).

    `params` maps HF names to ParamMeta (see `param_metas`); `num_layers` is needed when pp > 1.
    `src_box` / `dst_box` replace the layouts' Megatron split rule where an engine slices differently
    (e.g. vLLM pads the vocabulary before splitting it and replicates kv heads when tp > num_kv_heads);
    the layouts still name the ranks.
    """
    params = dict(params)
    src_box = src_box or (lambda n, shape, r: src.box(n, shape, r, num_layers=num_layers))
    dst_box = dst_box or (lambda n, shape, r: dst.box(n, shape, r, num_layers=num_layers))
    src_boxes, dst_boxes = {}, {}
    load = {r: 0 for r in src.ranks}
    transfers: list[Transfer] = []
    for name, meta in params.items():
        # Replicas hold identical boxes (Megatron dp on the source side, generation dp on the
        # destination side): cut each distinct destination box against each distinct source box once.
        groups: dict[Box, list[int]] = {}
        for r in src.ranks:
            b = src_box(name, meta.shape, r)
            if b is not None and not b.empty:
                src_boxes[(name, r)] = b
                groups.setdefault(b, []).append(r)
        cells: dict[Box, list] = {}
        for r in dst.ranks:
            need = dst_box(name, meta.shape, r)
            if need is None or need.empty:
                continue
            dst_boxes[(name, r)] = need
            if need not in cells:
                cells[need] = _candidates(need, groups, name)
            transfers += _plan_one(name, r, cells[need], src_boxes.get((name, r)), load, meta.itemsize)
    return Plan(params, src, dst, transfers, src_boxes, dst_boxes)


_PLAN_CACHE: dict[tuple, Plan] = {}
_PLAN_CACHE_SIZE = 8


def cached_plan(params: Mapping[str, ParamMeta], *, src: Layout, dst: Layout, num_layers: int | None = None,
                src_box: BoxFn | None = None, dst_box: BoxFn | None = None) -> Plan:
    """`plan_reshard` memoised on its inputs: a layout pair's plan is the same at every weight sync.

    Box functions are part of the key by identity: pass the same function object to hit the cache.
    """
    key = (tuple(params.items()), src, dst, num_layers, src_box, dst_box)
    if key not in _PLAN_CACHE:
        if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
            _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
        _PLAN_CACHE[key] = plan_reshard(params, src=src, dst=dst, num_layers=num_layers,
                                        src_box=src_box, dst_box=dst_box)
    return _PLAN_CACHE[key]


def split_box(box: Box, max_numel: int) -> list[Box]:
    """Split `box` into row-major consecutive boxes of at most `max_numel` elements each.

    Splits along dim 0 first; when one dim-0 slab is already too large, each slab is split further
    along the next dim (recursively), so any positive `max_numel` works.
    """
    assert max_numel >= 1
    if box.numel <= max_numel or not box.sizes:
        return [box]
    inner = box.numel // box.sizes[0]
    if inner <= max_numel:
        step = max_numel // inner
        out = []
        for lo in range(0, box.sizes[0], step):
            n = min(step, box.sizes[0] - lo)
            out.append(Box((box.offsets[0] + lo,) + box.offsets[1:], (n,) + box.sizes[1:]))
        return out
    out = []
    for i in range(box.sizes[0]):
        rest = Box(box.offsets[1:], box.sizes[1:])
        for b in split_box(rest, max_numel):
            out.append(Box((box.offsets[0] + i,) + b.offsets, (1,) + b.sizes))
    return out


ALIGN = 16  # bytes: every piece starts aligned in the flat byte buffers so `.view(dtype)` is legal


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def make_buckets(plan: Plan, *, bucket_bytes: int) -> list[list[Transfer]]:
    """Group the plan's transfers into buckets; per rank, bytes sent + received in a bucket <= bucket_bytes.

    Transfers bigger than a bucket are split (`split_box`). Buckets keep parameter order so the
    consumer sees weights stream in. Every rank computes the same buckets (pure function).
    """
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes} is too small; use at least {ALIGN} bytes (e.g. 256 MB)")
    buckets: list[list[Transfer]] = [[]]
    used: dict[int, int] = {}
    for t in plan.transfers:
        itemsize = plan.params[t.name].itemsize
        # Keep the aligned size of a piece within the bucket even in the worst padding case.
        max_numel = max(1, (bucket_bytes - ALIGN) // itemsize)
        pieces = [t] if t.local or t.box.numel <= max_numel else [
            Transfer(t.name, b, t.src, t.dst) for b in split_box(t.box, max_numel)
        ]
        for p in pieces:
            cost = 0 if p.local else aligned(p.box.numel * itemsize)
            if cost and (used.get(p.src, 0) + cost > bucket_bytes or used.get(p.dst, 0) + cost > bucket_bytes):
                buckets.append([])
                used = {}
            buckets[-1].append(p)
            if cost:
                used[p.src] = used.get(p.src, 0) + cost
                used[p.dst] = used.get(p.dst, 0) + cost
    return [b for b in buckets if b]
