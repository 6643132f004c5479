"""The range of every numeric config field and the choices of every named one, as two tables.

Checked first, in the driver, before anything else looks at the values: a value out of range makes
the cross-field checks meaningless (`resources.nodes=0` would otherwise surface as "rollout.tp is
larger than the actor group"), so when a range is violated only range problems are reported, and
each names the key, the value, the rule, and a value that works (the schema's default).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from rlframe.config.schema import RunConfig


@dataclass(frozen=True)
class Rule:
    ok: Callable[[Any], bool]
    need: str  # what a valid value is, e.g. ">= 1"
    why: str = ""


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def at_least(lo, why: str = "") -> Rule:
    return Rule(lambda x: _num(x) and x >= lo, f">= {lo}", why)


def above(lo, why: str = "") -> Rule:
    return Rule(lambda x: _num(x) and x > lo, f"> {lo}", why)


def within(lo, hi, *, open_lo: bool = False, open_hi: bool = False, why: str = "") -> Rule:
    def ok(x):
        return _num(x) and (x > lo if open_lo else x >= lo) and (x < hi if open_hi else x <= hi)

    return Rule(ok, f"in {'(' if open_lo else '['}{lo}, {hi}{')' if open_hi else ']'}", why)


POSITIVE_INT = at_least(1)
# The engines' choices, defined here (the engines import them): importing an engine would import
# torch, and a config error must be reported before that second is spent.
LR_SCHEDULES = ("constant", "cosine")
PRECISIONS = ("auto", "fp32", "bf16")

_TRAIN_ROLE = {
    "dp": POSITIVE_INT, "tp": POSITIVE_INT, "pp": POSITIVE_INT, "sp": POSITIVE_INT, "cp": POSITIVE_INT,
    "lr": above(0, " (the learning rate of AdamW)"),
    "weight_decay": at_least(0),
    "grad_clip": above(0, " (the maximum global gradient norm)"),
    "warmup_steps": at_least(0, " (optimizer steps of linear warm-up)"),
    "min_lr_ratio": within(0, 1, why=" (the cosine schedule's final learning rate over lr)"),
    "ppo_epochs": POSITIVE_INT,
    "mini_batch_size": at_least(1, " (samples per optimizer step)"),
    "micro_batch_size": at_least(1, " (samples per forward/backward; null: the whole per-rank mini-batch)"),
    "max_tokens_per_micro_batch": at_least(1, " (null: micro-batches by count)"),
    "cliprange_value": above(0),
    "lora_rank": at_least(0, " (0: no LoRA; e.g. 8 for rank-8 adapters)"),
    "lora_alpha": above(0, " (the adapters' output is scaled by lora_alpha / lora_rank)"),
    "lora_dropout": within(0, 1, open_hi=True, why=" (dropout on the adapters' input; 0: none)"),
}

# key -> rule; fields that may be null skip the rule when they are.
RANGES: dict[str, Rule] = {
    "model.tiny_pretrain_steps": at_least(0),
    "data.train_size": POSITIVE_INT,
    "data.val_size": at_least(0, " (0: no held-out set)"),
    "data.prompt_length": POSITIVE_INT,
    "data.response_length": at_least(1, " (the maximum number of generated tokens)"),
    "data.train_batch_size": at_least(1, " (prompts per step)"),
    "data.seed": at_least(0),
    "algorithm.gamma": within(0, 1, why=" (a discount factor)"),
    "algorithm.lam": within(0, 1, why=" (the GAE lambda)"),
    "algorithm.n_samples": at_least(1, " (responses per prompt)"),
    "algorithm.kl_coef": at_least(0),
    "algorithm.kl_target": above(0, " (null: a fixed kl_coef)"),
    "algorithm.kl_horizon": POSITIVE_INT,
    "algorithm.kl_loss_coef": at_least(0),
    "algorithm.clip_ratio_low": within(0, 1, open_hi=True, why=" so that 1 - clip_ratio_low > 0"),
    "algorithm.clip_ratio_high": at_least(0),
    "algorithm.clip_ratio_c": above(1, " (dual-clip bound; 3.0 is usual)"),
    "algorithm.entropy_coef": at_least(0, " (a bonus; 0 turns it off)"),
    "algorithm.max_gen_batches": POSITIVE_INT,
    "algorithm.overlong_buffer_len": at_least(0, " (0: no overlong shaping)"),
    "algorithm.overlong_penalty_factor": at_least(0),
    "algorithm.dpo_beta": above(0),
    "algorithm.loss_scale_factor": above(0, " (null: data.response_length)"),
    **{f"actor.{k}": r for k, r in _TRAIN_ROLE.items()},
    **{f"critic.{k}": r for k, r in _TRAIN_ROLE.items()},
    "rollout.tp": POSITIVE_INT,
    "rollout.temperature": at_least(0, " (0: greedy)"),
    "rollout.top_p": within(0, 1, open_lo=True, why=" (1: no nucleus cut)"),
    "rollout.top_k": Rule(lambda x: _num(x) and (x == -1 or x >= 1), "-1 (off) or >= 1"),
    "rollout.val_temperature": at_least(0, " (0: greedy)"),
    "rollout.val_n": POSITIVE_INT,
    "rollout.max_num_seqs": POSITIVE_INT,
    "rollout.gpu_memory_utilization": within(0, 1, open_lo=True, why=" (a fraction of GPU memory)"),
    "rollout.kv_cache_bytes": at_least(1 << 20, " (1 MiB; null: 256 MiB on CPU, on GPU what gpu_memory_utilization leaves after the weights)"),
    "rollout.bucket_bytes": at_least(1 << 20, " (1 MiB; weights move in buckets of this size)"),
    "rollout.delta_full_every": at_least(1, " (syncs; 1: every delta sync is a full one)"),
    "reward.num_workers": at_least(0, " (0: score in the driver)"),
    "reward.max_error_fraction": within(0, 1, why=" (of a batch's rewards that may fail; 1.0: never stop)"),
    "resources.nodes": POSITIVE_INT,
    "resources.procs_per_node": POSITIVE_INT,
    "resources.cpus_per_proc": above(0),
    "resources.node_wait_s": at_least(0, " (seconds a run waits for a lost node's return; 0: fail at once)"),
    "resources.device_memory_gib": above(0, " (GiB of one GPU as torch.cuda.mem_get_info reports it, e.g. 79.19 "
                                            "for an H100 80GB; null: the visible GPU's, else 79.19)"),
    "ray.num_cpus": POSITIVE_INT,
    "trainer.total_steps": POSITIVE_INT,
    "trainer.val_every": at_least(0, " (0: no validation)"),
    "trainer.save_every": at_least(0, " (0: only at the end)"),
    "trainer.save_every_minutes": at_least(0, " (minutes between checkpoints; 0: off)"),
    "trainer.preempt_grace_s": at_least(0, " (seconds a preempted run has to checkpoint)"),
    "trainer.keep_checkpoints": POSITIVE_INT,
    "trainer.seed": at_least(0),
    "trainer.max_restarts": at_least(0, " (0: a dead worker ends the run)"),
    "trainer.max_nonfinite_steps": POSITIVE_INT,
    "trainer.collective_timeout_s": at_least(10, " (seconds; a checkpoint write or model load on one rank must fit)"),
    "trainer.max_staleness": at_least(0, " (0: synchronous)"),
    "trainer.prometheus_port": within(0, 65535, why=" (the driver's /metrics port; 0: no endpoint)"),
    "trainer.critic_warmup": at_least(0, " (steps that update only the critic; 0: off)"),
    "trainer.rollout_dump_every": at_least(0, " (steps between generation dumps; 0: off)"),
    "trainer.rollout_dump_rows": POSITIVE_INT,
    "trainer.rollout_dump_max_mb": above(0, " (MiB a generations file reaches before it is rotated)"),
    "rollout.partial_budget": at_least(0, " (0: whole responses in one round)"),
    "agent.max_turns": at_least(1, " (assistant turns per trajectory)"),
    "agent.max_result_chars": at_least(1, ""),
    "agent.concurrency": at_least(0, " (episodes at once, 0 all of a rollout's, agent.mode=openai)"),
    "agent.episode_timeout_s": above(0, " (seconds an episode may take, agent.mode=openai)"),
    "algorithm.tis_cap": at_least(1.0, " (the largest importance weight kept)"),
    "algorithm.mask_low": above(0, " (ratios below it are masked; null: the method's default)"),
    "algorithm.mask_high": above(0, " (ratios above it are masked; null: the method's default)"),
    "algorithm.rejection_kl": above(0, " (the largest mean per-token KL a response may have; null: off)"),
}


# trainer.loggers: the metric sinks rlframe/controller/lifecycle/tracking.py writes to
SINKS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")

# algorithm.dynamic_sampling_at_cap: what DAPO's dynamic sampling does with a batch still short of
# informative groups after max_gen_batches rounds (rlframe/controller/trainers/dynamic_sampling.py)
DYNAMIC_SAMPLING_AT_CAP = ("refill", "train_kept", "stop")


def _choices() -> dict[str, tuple]:
    from rlframe.data.synthetic import TASKS
    from rlframe.data.tool_task import DATA_SOURCE as TOOL_TASK
    from rlframe.data.tiny_model import PRESETS

    from rlframe.algos.rollout_correction import METHODS as OFF_POLICY_CORRECTIONS
    from rlframe.plugins import ROLLOUT_BACKENDS, TRAIN_ENGINES  # the registries (no torch)
    from rlframe.resharding.transport import WEIGHT_TRANSPORTS

    roles = {f"{r}.{k}": v for r in ("actor", "critic") for k, v in
             (("strategy", TRAIN_ENGINES.names()), ("lr_schedule", LR_SCHEDULES), ("precision", PRECISIONS))}
    return {"model.tiny_preset": tuple(sorted(PRESETS)), "data.task": (None, *TASKS, TOOL_TASK), **roles,
            "rollout.backend": ("auto", *ROLLOUT_BACKENDS.names()), "rollout.load_format": ("auto", "real"),
            "rollout.weight_sync": ("full", "delta"),
            "rollout.weight_transport": WEIGHT_TRANSPORTS,
            "rollout.weight_fanout": ("direct", "chain"),
            "agent.mode": ("tools", "openai"),
            "reward.ensemble": ("mean", "min"),
            "resources.placement": ("colocated", "split"), "trainer.loggers": SINKS,
            "trainer.async_mode": ("batch", "stream"),
            "algorithm.off_policy_correction": OFF_POLICY_CORRECTIONS,
            "algorithm.dynamic_sampling_at_cap": DYNAMIC_SAMPLING_AT_CAP}


def lookup(cfg: RunConfig, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def default_of(key: str):
    section, name = key.split(".")
    for f in dataclasses.fields(RunConfig):
        if f.name == section:
            for g in dataclasses.fields(f.default_factory()):
                if g.name == name:
                    return g.default if g.default is not dataclasses.MISSING else g.default_factory()
    raise KeyError(key)


def _skipped(cfg: RunConfig, key: str) -> bool:
    """Sections the run does not use are not checked (a GRPO config may leave critic.* as it is)."""
    return key.startswith("critic.") and not cfg.uses_critic


def check_ranges(cfg: RunConfig) -> list[str]:
    out = []
    for key, rule in RANGES.items():
        value = lookup(cfg, key)
        if value is None or _skipped(cfg, key) or rule.ok(value):
            continue
        default = default_of(key)
        fix = f"e.g. {key}={default} (the default)" if default is not None and rule.ok(default) else \
            f"or {key}=null"
        out.append(f"{key}={value!r} is out of range: it must be {rule.need}{rule.why}; set a value {rule.need}, {fix}")
    for key, allowed in _choices().items():
        value = lookup(cfg, key)
        if _skipped(cfg, key):
            continue
        bad = [v for v in value if v not in allowed] if isinstance(value, list) else \
            ([value] if value not in allowed else [])
        if bad:
            shown = ", ".join("null" if a is None else str(a) for a in allowed)
            out.append(f"{key}={value!r}: {', '.join(map(repr, bad))} is not one of {shown}; "
                       f"set {key} to one of them")
    return out
