"""How many optimizer steps a role takes in a run: the length of its learning-rate schedule.

A role takes one optimizer step per mini-batch: `ppo_epochs` passes over the step's rows
(`data.train_batch_size * algorithm.n_samples`) in mini-batches of `mini_batch_size` rows, every
trainer step. The engines' schedules (warm-up, cosine decay) count optimizer steps, so their length
must be this, never `trainer.total_steps * ppo_epochs` (with 4 mini-batches per step a cosine
schedule would reach 0 a quarter of the way through the run).
"""

from __future__ import annotations

import math


def rows_per_step(cfg) -> int:
    """Rows a role trains on per trainer step (a pair algorithm's: at most one pair per prompt, its 2 samples)."""
    return cfg.data.train_batch_size * max(1, cfg.algorithm.n_samples)


def optimizer_steps_per_step(cfg, role) -> int:
    """`role.ppo_epochs` x mini-batches per epoch."""
    return max(1, role.ppo_epochs) * max(1, math.ceil(rows_per_step(cfg) / role.mini_batch_size))


def optimizer_steps(cfg, role, *, actor: bool = False) -> int:
    """The role's optimizer steps over the whole run: the length of its learning-rate schedule. The
    actor takes none in the first trainer.critic_warmup steps."""
    steps = cfg.trainer.total_steps - (cfg.trainer.critic_warmup if actor else 0)
    return max(1, steps) * optimizer_steps_per_step(cfg, role)
