"""DAPO's dynamic sampling and overlong reward shaping (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", arXiv:2503.14476), as functions the trainer calls.

Dynamic sampling (Sec. 3.2): a group whose n rewards are all equal has zero group-relative
advantage and so gives no gradient; drop such groups and keep generating until the batch holds
the wanted number of groups. The trainer's loop:

    progress = DynamicSamplingProgress(target_num_groups=train_batch_size, max_num_gen_batches=10)
    kept = None
    while True:
        gen = generate_and_score(next(dataloader))
        result = filter_groups_by_reward_variance(scores=seq_scores, index=gen.non_tensor_batch["uid"])
        part = gen.index(result.kept_indices)
        kept = part if kept is None else DataProto.concat([kept, part])
        if progress.update(result):
            break
    batch = kept.index(first_groups(kept.non_tensor_batch["uid"], num_groups=train_batch_size))

Overlong reward shaping (Sec. 3.4, eq. 13): `overlong_reward_penalty` is added to the score.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlframe.algos.grouping import group_rows


@dataclass(frozen=True)
class GroupFilterResult:
    """Outcome of `filter_groups_by_reward_variance`.

    kept_indices: (K,) int64 numpy array of the rows kept, in batch order.
    kept_group_ids: ids of the kept groups, in order of first appearance.
    num_groups, num_kept_groups: groups in the batch, and how many were kept.
    """

    kept_indices: np.ndarray
    kept_group_ids: list[Any]
    num_groups: int
    num_kept_groups: int

    @property
    def num_dropped_groups(self) -> int:
        return self.num_groups - self.num_kept_groups


@torch.no_grad()
def filter_groups_by_reward_variance(*, scores: torch.Tensor | np.ndarray, index: Any, atol: float = 0.0) -> GroupFilterResult:
    """Keep the groups whose rewards are not all equal (max - min > atol).

    Args:
        scores (B,): one metric per response, usually its outcome reward (the sum of its
            token-level scores) or its accuracy. index (B,): group id per response (`uid`).
        atol: rewards closer than this count as equal (0: exact equality).
    Raises ValueError for a group of one response: its rewards are trivially equal, so with n = 1
    dynamic sampling could never fill a batch; it needs n >= 2 samples per prompt.
    """
    scores = torch.as_tensor(scores)
    if scores.dim() != 1:
        raise ValueError(f"scores must be (B,), one value per response; got shape {tuple(scores.shape)}")
    groups = group_rows(index, batch_size=scores.shape[0])
    groups.require_min_size(2, algorithm="DAPO dynamic sampling",
                            why="a single reward has no variance, so the group would always be dropped")
    s = scores.to(torch.float64).cpu()
    neg_inf = torch.full((groups.num_groups,), float("-inf"), dtype=torch.float64)
    gmax = neg_inf.scatter_reduce(0, groups.inverse, s, reduce="amax")
    gmin = (-neg_inf).scatter_reduce(0, groups.inverse, s, reduce="amin")
    keep_group = (gmax - gmin) > atol
    kept_rows = keep_group[groups.inverse]
    return GroupFilterResult(
        kept_indices=torch.nonzero(kept_rows).flatten().numpy().astype(np.int64),
        kept_group_ids=[gid for gid, k in zip(groups.ids, keep_group.tolist()) if k],
        num_groups=groups.num_groups,
        num_kept_groups=int(keep_group.sum()),
    )


def first_groups(index: Any, *, num_groups: int) -> np.ndarray:
    """(K,) int64 rows of the first `num_groups` groups (order of first appearance), in batch order.

    Dynamic sampling usually overshoots; this trims the accumulated batch to whole groups.
    """
    groups = group_rows(index, batch_size=len(index))
    if num_groups > groups.num_groups:
        raise ValueError(f"asked for the first {num_groups} groups but the batch has only {groups.num_groups}")
    return torch.nonzero(groups.inverse < num_groups).flatten().numpy().astype(np.int64)


@dataclass
class DynamicSamplingProgress:
    """Counts kept groups across generation rounds until the batch is full.

    target_num_groups: groups (prompts) the training batch needs.
    max_num_gen_batches: generation rounds allowed per training step (<= 0: unlimited). Exceeding it
        is a ValueError, because a task the policy always (or never) solves would loop forever.
    """

    target_num_groups: int
    max_num_gen_batches: int = 0
    num_gen_batches: int = field(default=0, init=False)
    num_kept_groups: int = field(default=0, init=False)

    def __post_init__(self):
        if self.target_num_groups <= 0:
            raise ValueError(f"target_num_groups must be > 0, got {self.target_num_groups}")

    def update(self, result: GroupFilterResult) -> bool:
        """Record one generation round; True once enough groups are kept."""
        self.num_gen_batches += 1
        self.num_kept_groups += result.num_kept_groups
        if self.num_kept_groups >= self.target_num_groups:
            return True
        if 0 < self.max_num_gen_batches <= self.num_gen_batches:
            raise ValueError(
                f"dynamic sampling kept {self.num_kept_groups} of the {self.target_num_groups} groups needed "
                f"after {self.num_gen_batches} generation batches (max_num_gen_batches="
                f"{self.max_num_gen_batches}): too many prompts get identical rewards for all samples. "
                f"Raise max_num_gen_batches (0 = unlimited), sample more responses per prompt, or use "
                f"prompts of more suitable difficulty."
            )
        return False

    def reset(self) -> None:
        """Start counting for the next training step."""
        self.num_gen_batches = 0
        self.num_kept_groups = 0


def overlong_reward_penalty(
    *,
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13): (B,) lengths -> (B,) penalties in [-penalty_factor, 0].

    With L_max = max_response_length and L_cache = overlong_buffer_len:
        0                                       if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache     if L_max - L_cache < |y| <= L_max
        -1                                      if |y| > L_max
    times penalty_factor; added to the response's reward so long answers lose reward gradually
    instead of all at once at truncation.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in (0, max_response_length={max_response_length}], got "
            f"{overlong_buffer_len}; the penalty ramps up over the last overlong_buffer_len tokens"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0 (penalties are subtracted), got {penalty_factor}")
    lengths = torch.as_tensor(response_lengths).to(torch.float32)
    expected = float(max_response_length - overlong_buffer_len)
    ramp = (expected - lengths) / overlong_buffer_len
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), ramp)
    penalty = torch.where(lengths > max_response_length, torch.full_like(lengths, -1.0), penalty)
    return penalty * penalty_factor
