"""Checks of `algorithm.dynamic_sampling_at_cap` (DAPO: what a step does when `max_gen_batches`
generation rounds left its batch short of groups whose rewards differ; the trainer's side is
rlframe/controller/trainers/dynamic_sampling.py)."""

from __future__ import annotations

from rlframe.config.schedule import rows_per_step


def at_cap_problems(cfg) -> list[str]:
    alg = cfg.algorithm
    mode = alg.dynamic_sampling_at_cap
    if mode == "refill":  # the default (and an unknown value is said by the choices' check)
        return []
    if not alg.dynamic_sampling:
        return [f"algorithm.dynamic_sampling_at_cap={mode} has no effect: it says what dynamic sampling does at "
                "algorithm.max_gen_batches, and algorithm.dynamic_sampling=false; set algorithm.dynamic_sampling=true "
                "(algorithm=dapo selects it), or remove the dynamic_sampling_at_cap override"]
    if mode != "train_kept":
        return []
    # A smaller batch is split into fewer mini-batches, so it takes fewer optimizer steps than a full
    # one; a schedule counts the full steps' (config/schedule.py). The dp split is kept by the trainer
    # (whole groups, rounded up to a multiple every data-parallel group divides).
    out = []
    rows = rows_per_step(cfg)
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.uses_critic else [])
    for name, role in roles:
        counts_steps = role.lr_schedule != "constant" or role.warmup_steps > 0
        if counts_steps and role.mini_batch_size < rows:
            schedule = f"{name}.lr_schedule={role.lr_schedule}" + (
                f" with {name}.warmup_steps={role.warmup_steps}" if role.warmup_steps > 0 else "")
            out.append(f"algorithm.dynamic_sampling_at_cap=train_kept trains a step short of informative groups on "
                       f"fewer rows, and {name}.mini_batch_size={role.mini_batch_size} splits the step's {rows} rows "
                       f"into {-(-rows // role.mini_batch_size)} optimizer steps, so a smaller batch takes fewer: "
                       f"{schedule} counts the full steps' optimizer steps and would fall behind; set "
                       f"{name}.mini_batch_size={rows} (one optimizer step per epoch), a constant schedule "
                       f"without warm-up, or algorithm.dynamic_sampling_at_cap=refill")
    return out
