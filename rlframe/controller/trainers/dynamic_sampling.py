"""DAPO's dynamic sampling as the trainer runs it: generation rounds until the batch holds enough
groups whose rewards differ, and what happens when `algorithm.max_gen_batches` rounds did not find
enough (`algorithm.dynamic_sampling_at_cap`):

- refill (the default): the batch is topped up with the first groups whose rewards were all equal.
  Their advantages are zero, so they carry no signal, but they count in the loss's normaliser
  (tokens or rows of the mini-batch): with a fraction f of informative rows the policy gradient is
  about f times a full batch's (kept_ratio 0.125: about 8x smaller). The console says so.
- train_kept: the step trains on the kept groups only, a smaller batch (rounded up, with equal-reward
  groups, to a multiple of the rows every data-parallel group must split evenly; at least one such
  multiple when nothing was kept).
- stop: the run ends with `DynamicSamplingExhausted`, naming the numbers and the settings to change.

`fill_with_informative_groups` is the loop, free of the worker groups: `more(round)` returns the next
round's scored batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from rlframe.algos.dapo import filter_groups_by_reward_variance
from rlframe.config.ranges import DYNAMIC_SAMPLING_AT_CAP as AT_CAP_CHOICES
from rlframe.protocol import DataProto


class DynamicSamplingExhausted(RuntimeError):
    """algorithm.dynamic_sampling_at_cap=stop: the generation cap was reached with the batch short."""


def row_unit(cfg) -> int:
    """The rows a step's batch must be a multiple of: whole groups (n_samples), split evenly over the
    data-parallel ranks of every group that takes the batch (the actor's, which the reference follows,
    and the critic's)."""
    sizes = [max(1, cfg.algorithm.n_samples), max(1, cfg.actor.dp)]
    if cfg.uses_critic:
        sizes.append(max(1, cfg.critic.dp))
    return math.lcm(*sizes)


@dataclass(frozen=True)
class CapReached:
    """A step whose generation rounds hit the cap with fewer informative rows than the batch wants."""

    step: int | None
    rounds: int
    kept_rows: int
    kept_groups: int
    want: int
    trained_rows: int
    mode: str

    @property
    def informative(self) -> float:
        """The fraction of the trained rows whose group's rewards differ."""
        return min(self.kept_rows, self.trained_rows) / self.trained_rows if self.trained_rows else 0.0

    def line(self, *, loss_agg_mode: str) -> str:
        """One console line: what happened, its effect, what to change."""
        where = f"step {self.step}: " if self.step is not None else ""
        head = (f"dynamic sampling {where}after algorithm.max_gen_batches={self.rounds} generation rounds only "
                f"{self.kept_rows} of the {self.want} rows ({self.kept_groups} group(s)) have rewards that differ; ")
        if self.mode == "refill":
            filler = self.trained_rows - min(self.kept_rows, self.trained_rows)
            return head + (f"{filler} rows of equal-reward groups (advantage 0) refill the batch, so under "
                           f"loss_agg_mode={loss_agg_mode} this step's policy gradient is about "
                           f"{self.informative:.3g}x a full batch's (algorithm.dynamic_sampling_at_cap=train_kept "
                           "trains on the kept groups only, =stop ends the run; or raise algorithm.max_gen_batches)")
        extra = self.trained_rows - self.kept_rows
        padded = f" (with {extra} rows of equal-reward groups, to split evenly)" if extra > 0 else ""
        size = f"a smaller batch of {self.trained_rows} rows" if self.trained_rows < self.want else \
            f"{self.trained_rows} rows"
        return head + f"training on {size}{padded} (algorithm.dynamic_sampling_at_cap=train_kept)"

    def error(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        return (f"DAPO dynamic sampling{where}: after algorithm.max_gen_batches={self.rounds} generation rounds only "
                f"{self.kept_rows} of the {self.want} rows ({self.kept_groups} group(s)) have rewards that differ, "
                "and algorithm.dynamic_sampling_at_cap=stop ends the run there. The prompts are too easy or too hard "
                "for the model (every sample right, or every one wrong); raise algorithm.max_gen_batches, filter the "
                "data, or set algorithm.dynamic_sampling_at_cap=refill (pad with equal-reward groups) or "
                "train_kept (train on a smaller batch)")


def fill_with_informative_groups(
    batch: DataProto, more: Callable[[int], DataProto], *, max_gen_batches: int, at_cap: str = "refill",
    unit: int = 1, step: int | None = None,
) -> tuple[DataProto, dict, CapReached | None]:
    """Keep the groups of `batch` (scored: `token_level_scores`, `uid`) whose rewards differ; while
    fewer than len(batch) rows are kept and fewer than `max_gen_batches` rounds ran, call
    `more(round)` (round = 2, 3, ...) for another scored batch. Returns the batch to train on, the
    `dapo/*` metrics, and a `CapReached` when the cap left the batch short (None otherwise).
    Raises DynamicSamplingExhausted then with at_cap="stop"."""
    from rlframe.controller.trainers.phases import align_reward_extras, reward_metrics

    if at_cap not in AT_CAP_CHOICES:
        raise ValueError(f"at_cap={at_cap!r}: choose one of {', '.join(AT_CAP_CHOICES)}")
    want = len(batch)
    kept, dropped, rounds, kept_groups = [], [], 1, 0
    while True:
        res = filter_groups_by_reward_variance(scores=batch.batch["token_level_scores"].sum(-1),
                                               index=batch.non_tensor_batch["uid"])
        keep = torch.as_tensor(res.kept_indices, dtype=torch.long)
        mask = torch.ones(len(batch), dtype=torch.bool)
        mask[keep] = False
        kept.append(batch.index(keep))
        dropped.append(batch.index(mask))
        kept_groups += res.num_kept_groups
        if sum(len(k) for k in kept) >= want or rounds >= max_gen_batches:
            break
        rounds += 1
        batch = more(rounds)
    pool = DataProto.concat(align_reward_extras([*kept, *dropped]))  # kept rows first, whole groups
    n_kept = sum(len(k) for k in kept)
    capped = None
    rows = want
    if n_kept < want:
        if at_cap == "train_kept":  # whole groups, a multiple of `unit` (want is one), at least one unit
            rows = min(want, max(unit, -(-n_kept // unit) * unit))
        capped = CapReached(step=step, rounds=rounds, kept_rows=n_kept, kept_groups=kept_groups, want=want,
                            trained_rows=rows, mode=at_cap)
        if at_cap == "stop":
            raise DynamicSamplingExhausted(capped.error())
    every_round = {f"dapo/all_rounds/{k}": v for k, v in reward_metrics(pool).items()}
    metrics = {"dapo/gen_batches": rounds, "dapo/kept_ratio": min(1.0, n_kept / want),
               "dapo/trained_rows": rows, "dapo/informative_ratio": min(n_kept, rows) / rows if rows else 0.0,
               **every_round}
    return pool.index(slice(0, rows)), metrics, capped
