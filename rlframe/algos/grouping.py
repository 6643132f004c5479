"""Group membership: the n responses sampled for one prompt share a group id (`uid`).

The ids arrive in whatever form the batch carries them: a numpy object array of strings (the `uid`
non-tensor field of DataProto), a numpy int array, an int tensor, or a list. They are mapped to
dense group numbers 0..G-1 in order of first appearance, which keeps results independent of how
the ids sort and lets "the first k groups" mean the first k prompts of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Groups:
    """Dense group numbering of a batch.

    inverse: (B,) int64 tensor, the group number of each row.
    ids: the original id of each group number (length G), in order of first appearance.
    counts: (G,) int64 tensor, rows per group.
    """

    inverse: torch.Tensor
    ids: list[Any]
    counts: torch.Tensor

    @property
    def num_groups(self) -> int:
        return len(self.ids)

    def require_min_size(self, min_size: int, *, algorithm: str, why: str) -> None:
        """ValueError naming the first too-small group when an algorithm is undefined for it."""
        small = torch.nonzero(self.counts < min_size).flatten()
        if small.numel():
            g = int(small[0])
            raise ValueError(
                f"{algorithm}: group {self.ids[g]!r} has {int(self.counts[g])} sample(s) but needs at "
                f"least {min_size} ({why}); {small.numel()} of {self.num_groups} groups are that small. "
                f"Sample n >= {min_size} responses per prompt (the rollout's n)."
            )


def _to_list(index: Any) -> list:
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D (B,), got a tensor of shape {tuple(index.shape)}")
        return index.tolist()
    if isinstance(index, np.ndarray):
        if index.ndim != 1:
            raise ValueError(f"index must be 1-D (B,), got an array of shape {index.shape}")
        return index.tolist()
    if isinstance(index, Sequence) and not isinstance(index, (str, bytes)):
        return list(index)
    raise ValueError(
        f"index must be a 1-D numpy array, tensor or list of group ids, got {type(index).__name__}"
    )


def group_rows(index: Any, *, batch_size: int, device: torch.device | str = "cpu") -> Groups:
    """Map group ids (B,) to dense group numbers; ValueError if the length is not batch_size."""
    if index is None:
        raise ValueError("index (the group id of each sample, e.g. the batch's 'uid' field) is required")
    ids = _to_list(index)
    if len(ids) != batch_size:
        raise ValueError(f"index has {len(ids)} group ids but the batch has {batch_size} rows (B)")
    numbering: dict[Any, int] = {}
    inverse = [numbering.setdefault(i, len(numbering)) for i in ids]
    inv = torch.tensor(inverse, dtype=torch.long, device=device)
    counts = torch.bincount(inv, minlength=len(numbering)) if ids else torch.zeros(0, dtype=torch.long)
    return Groups(inverse=inv, ids=list(numbering), counts=counts)


def group_mean(x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(G,) mean of the (B,) values x within each group."""
    sums = torch.zeros(groups.num_groups, dtype=x.dtype, device=x.device).index_add_(0, groups.inverse, x)
    return sums / groups.counts.to(x)


def group_max(x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(G,) the largest of the (B,) values x within each group."""
    out = torch.full((groups.num_groups,), -torch.inf, dtype=x.dtype, device=x.device)
    return out.scatter_reduce(0, groups.inverse, x, reduce="amax")


def group_std(x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(G,) unbiased (Bessel-corrected, like torch.std) standard deviation within each group.

    Undefined for groups of one sample; callers check sizes first (Groups.require_min_size).
    """
    mean = group_mean(x, groups)
    sq = torch.zeros_like(mean).index_add_(0, groups.inverse, (x - mean[groups.inverse]) ** 2)
    return torch.sqrt(sq / (groups.counts.to(x) - 1))


def group_is_constant(x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(G,) bool: every value of the group is exactly equal (max == min).

    Needed because a group's mean is not exact in floating point: eight rewards of 0.7 in float32
    have a mean a few ulps off 0.7, so s_i - mean is ~1e-8 rather than 0, and GRPO's division by
    (std + eps) with std ~ 1e-8 would turn that rounding into advantages of about 0.06.
    """
    big = torch.finfo(x.dtype).max if x.is_floating_point() else torch.iinfo(x.dtype).max
    gmax = torch.full((groups.num_groups,), -big, dtype=x.dtype, device=x.device)
    gmin = torch.full((groups.num_groups,), big, dtype=x.dtype, device=x.device)
    gmax = gmax.scatter_reduce(0, groups.inverse, x, reduce="amax")
    gmin = gmin.scatter_reduce(0, groups.inverse, x, reduce="amin")
    return gmax == gmin
