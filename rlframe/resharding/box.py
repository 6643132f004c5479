"""Box: a rectangular slice of a global tensor, the unit in which shards are described.

Every shard rlframe moves (an FSDP dim-0 shard, a column/row tensor-parallel shard, a vocab-parallel
embedding slice, a replicated norm) is a box: per-dimension offset and size inside the full tensor.
Training engines report the box each rank holds; generation layouts name the box each rank needs;
the resharding planner intersects them.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self):
        assert len(self.offsets) == len(self.sizes), (self.offsets, self.sizes)
        assert all(s >= 0 for s in self.sizes), self.sizes

    @classmethod
    def full(cls, shape) -> "Box":
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    @property
    def empty(self) -> bool:
        return self.numel == 0

    def slices(self) -> tuple[slice, ...]:
        """Index of this box inside the full tensor: `full[box.slices()]`."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: "Box") -> "Box | None":
        """The common part of two boxes of the same tensor, or None when they do not overlap."""
        assert len(self.offsets) == len(other.offsets), (self, other)
        offs, sizes = [], []
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(o1, o2), min(o1 + s1, o2 + s2)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of `outer` (which must contain it)."""
        rel = tuple(o - oo for o, oo in zip(self.offsets, outer.offsets))
        assert all(r >= 0 for r in rel) and all(
            r + s <= os for r, s, os in zip(rel, self.sizes, outer.sizes)
        ), (self, outer)
        return Box(rel, self.sizes)

    def contains(self, other: "Box") -> bool:
        return all(
            o <= oo and oo + os <= o + s
            for o, s, oo, os in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )


def chunk_box(shape, *, dim: int, index: int, parts: int) -> Box:
    """The box of `torch.chunk(full, parts, dim)[index]` (empty when that chunk does not exist).

    torch.chunk (and FSDP2's dim-0 sharding) gives each chunk ceil(n / parts) rows, the last ones
    possibly fewer or none; this mirrors it exactly.
    """
    n = int(shape[dim])
    step = -(-n // parts)
    lo = min(index * step, n)
    hi = min(lo + step, n)
    offs = [0] * len(shape)
    sizes = [int(s) for s in shape]
    offs[dim], sizes[dim] = lo, hi - lo
    return Box(tuple(offs), tuple(sizes))
