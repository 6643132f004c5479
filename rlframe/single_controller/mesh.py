"""Mesh: the named parallel dimensions of a worker group and each rank's coordinates in them.

A worker declares its mesh at init (e.g. `Mesh.of(pp=1, dp=2, tp=2)`); dispatch modes read it to
decide which ranks get which chunk of a batch and which ranks' outputs are collected. Ranks are
laid out row-major over the dims in the order given, outermost first, so the default order
(pp, dp, tp) is Megatron's: tp varies fastest, then dp, then pp.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

# Known dimension names, outermost first, in the canonical (Megatron) order.
# "sp" (Ulysses) sits where the fsdp engine's mesh has it: between dp and tp.
CANONICAL_ORDER = ("pp", "dp", "cp", "sp", "ep", "tp")


@dataclass(frozen=True)
class Mesh:
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self):
        if len(self.names) != len(self.sizes):
            raise ValueError(f"mesh names {self.names} and sizes {self.sizes} differ in length")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh dims must be unique, got {self.names}")
        bad = [f"{n}={s}" for n, s in zip(self.names, self.sizes) if not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"mesh sizes must be positive integers, got {', '.join(bad)}")

    @classmethod
    def of(cls, **sizes: int) -> "Mesh":
        """A mesh over the given dims, arranged in canonical order (pp, dp, cp, ep, tp)."""
        unknown = [n for n in sizes if n not in CANONICAL_ORDER]
        if unknown:
            raise ValueError(
                f"unknown mesh dims {unknown}; use names from {CANONICAL_ORDER} or build "
                "Mesh(names=..., sizes=...) to choose your own order"
            )
        names = tuple(n for n in CANONICAL_ORDER if n in sizes)
        return cls(names, tuple(int(sizes[n]) for n in names))

    @property
    def world_size(self) -> int:
        return prod(self.sizes)

    def size(self, name: str) -> int:
        """Size of a dim; 1 for a dim the mesh does not have."""
        return self.sizes[self.names.index(name)] if name in self.names else 1

    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            arithmetic = " * ".join(f"{n}({s})" for n, s in zip(self.names, self.sizes))
            raise ValueError(
                f"mesh {arithmetic} = {self.world_size} != world size {world_size}; "
                "make the product of the parallel sizes equal the number of workers in the group"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of `rank` (row-major, last dim fastest)."""
        assert 0 <= rank < self.world_size, (rank, self.world_size)
        out = {}
        for name, size in reversed(list(zip(self.names, self.sizes))):
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in self.names}

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for name, size in zip(self.names, self.sizes):
            rank = rank * size + coords.get(name, 0)
        return rank

    def __str__(self) -> str:
        return "-".join(f"{n}{s}" for n, s in zip(self.names, self.sizes))
