"""Sampling seeds that are a function of a sample's global identity, never of where it is computed.

A rollout batch is cut into chunks, one per generation replica (and padded to their count); an
engine that seeded its rows by their position in its own chunk (`seed + local_row * n`) would give
row i of replica 0 and row i of replica 1 the same seed: for two rows of one group (partial
rollouts and the agent loop send a group's n samples as n rows with n=1) the same prompt and the
same seed draw the same sample. So the driver computes each row's seed before the batch is split
and sends it along as the tensor `seed` (B,): the seed of the row's first sample; sample j of the
row uses `seed + j` (vLLM's convention for a request with n samples). Samples then do not depend
on the number of replicas, the dp chunking or the order of rows inside a chunk.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

SEED_KEY = "seed"
_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int | str) -> int:
    """A 31-bit seed from integers and strings (splitmix64 over each part; strings by crc32), equal on
    every process and machine (no Python hash randomisation)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        v = zlib.crc32(p.encode()) if isinstance(p, str) else int(p) & _MASK64
        h = (h ^ v) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h % (2**31 - 1)


def row_seeds(base: int, *, rows: int, n: int) -> torch.Tensor:
    """(rows,) seeds of a prompt batch whose row b carries samples b*n .. b*n+n-1: the seed of sample
    j of row b is base + b*n + j, so every sample of the batch has its own."""
    return base + torch.arange(rows, dtype=torch.long) * n


def seeds_for(identities: Sequence[Sequence[int | str]]) -> torch.Tensor:
    """(rows,) seeds, one per row, each mixed from that row's identity (e.g. (step seed, group uid,
    sample index, turn)) for rows that are one sample each (n=1)."""
    return torch.tensor([mix_seed(*ident) for ident in identities], dtype=torch.long)
