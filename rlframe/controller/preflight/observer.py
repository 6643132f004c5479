"""Watches a trainer's steps for `rlframe preflight`: the trainer calls `before_update(trainer, batch)`
with the batch its update is about to get (rollout, rewards, reference and old log-probs, advantages,
`meta_info` stamped) and `after_step(trainer, metrics)` with the step's metrics. What the run itself
did not compute (the training engine's log-probs of the sampled tokens) is computed here with the
batch's own `meta_info`, so whatever the trainer stamped is what is checked."""

from __future__ import annotations

import torch

from rlframe.config.algorithms import algorithm_spec
from rlframe.controller.preflight import checks
from rlframe.controller.preflight.checks import Check
from rlframe.controller.trainers import phases
from rlframe.protocol import DataProto
from rlframe.protocol.step import step_settings, with_step

REWARD_KEYS = ("responses", "response_mask", "attention_mask", "input_ids", "prompts", "position_ids")
LOGPROB_CAUSE = ("the training engine gives other log-probs than the rollout engine for the same tokens. "
                 "Settings involved: rollout.temperature (every log-prob call must use it: the step settings' temperature), "
                 "rollout.top_p / rollout.top_k (the rollout's log-probs are of the truncated distribution), "
                 "the weight sync (see the checksum check), actor.lora_dropout (forward passes with dropout on), "
                 "actor.precision / rollout dtype")
REF_CAUSE = ("actor and reference disagree before any update: the reference's temperature (meta_info stamped before "
             "compute_ref_log_prob), its weights (model.path), ref/actor precision, or LoRA adapters on in the reference")


class PreflightObserver:
    def __init__(self, cfg, *, precision: str):
        self.cfg, self.precision = cfg, precision
        self.results: list[Check] = []
        self.duplicates: dict[str, float] = {}  # duplicate_counts summed over the steps
        self.trainer = None  # the trainer observed (set after its first step)

    def add(self, step: int, found) -> None:
        for c in (found if isinstance(found, list) else [found]):
            if c is not None:
                c.step = step
                self.results.append(c)

    # ---- before the update -----------------------------------------------------------------------
    def before_update(self, trainer, batch: DataProto) -> None:
        cfg, step = self.cfg, trainer.step
        current = step == 1 or not cfg.off_policy  # the rollout came from the weights being trained
        train = trainer.roles.actor.compute_log_prob(batch).batch["old_log_probs"]
        mask = batch.batch["response_mask"]
        if current and "rollout_log_probs" in batch.batch.keys():
            self.add(step, checks.logprob_match(batch.batch["rollout_log_probs"], train, mask, precision=self.precision,
                                                what="rollout vs training engine", cause=LOGPROB_CAUSE))
            if "old_log_probs" in batch.batch.keys():
                self.add(step, checks.logprob_match(batch.batch["rollout_log_probs"], batch.batch["old_log_probs"],
                                                    mask, precision=self.precision, what="rollout vs the run's old",
                                                    cause=LOGPROB_CAUSE))
        if step == 1 and "ref_log_prob" in batch.batch.keys():
            self.add(step, checks.same_policy(train, batch.batch["ref_log_prob"], mask, precision=self.precision,
                                              name="actor vs reference at step 1 (k1 KL)", cause=REF_CAUSE))
        pairs = algorithm_spec(cfg.algorithm).pairs  # its batch holds (chosen, rejected) pairs, some repeated
        if not pairs and cfg.rollout.temperature > 0 and cfg.algorithm.n_samples > 1 and "uid" in batch.non_tensor_batch:
            counts = checks.duplicate_counts(batch)
            self.add(step, checks.duplicate_samples(counts, temperature=cfg.rollout.temperature))
            self.duplicates = {k: self.duplicates.get(k, 0.0) + v for k, v in counts.items()}
        if "advantages" in batch.batch.keys() and not phases.reweights(cfg):
            self.add(step, checks.group_zero_mean(batch, estimator=cfg.algorithm.adv_estimator))
        self.add(step, self._reward_repeats(trainer, batch))
        self.add(step, checks.nothing_after_end(batch, end_ids=trainer.end_ids))
        with_step(batch, step_settings(batch).but(report_first_minibatch=True))

    def _reward_repeats(self, trainer, batch: DataProto) -> Check | None:
        if "token_level_scores" not in batch.batch.keys():
            return None
        nt = [k for k in ("data_source", "ground_truth", "extra_info", "uid") if k in batch.non_tensor_batch]
        again = batch.select(batch_keys=[k for k in REWARD_KEYS if k in batch.batch.keys()], non_tensor_keys=nt)
        again, _ = trainer.score(again)
        return checks.reward_repeats(batch.batch["token_level_scores"].sum(-1), again.batch["token_level_scores"].sum(-1))

    def finish(self, steps: int) -> None:
        """Checks over the whole run: duplicates summed over its steps (more evidence than one step)."""
        if self.duplicates and steps > 1:
            self.add(steps, checks.duplicate_samples(self.duplicates, temperature=self.cfg.rollout.temperature,
                                                     scope=f" over {steps} steps"))

    # ---- after the step ---------------------------------------------------------------------------
    def after_step(self, trainer, metrics: dict) -> None:
        cfg, step = self.cfg, trainer.step
        ratio_applies = (not cfg.off_policy and algorithm_spec(cfg.algorithm).ppo_ratio
                         and cfg.actor.lora_dropout == 0 and "actor/first_mb_ppo_kl" in metrics)
        if ratio_applies:  # with LoRA dropout the update's own forward drops: its ratio is not 1 by design
            self.add(step, checks.first_minibatch_ratio(metrics, precision=self.precision))
        self.trainer = trainer
        trainer.request_weight_check(self.take_weight_sync)  # one comparison however many steps it waits
        if trainer.agent is not None and trainer.agent.turn_checks:
            self.add(step, trainer.agent.turn_checks)
            trainer.agent.turn_checks = []

    def take_weight_sync(self, result: dict) -> None:
        """The weight comparison's result (trainer.request_weight_check: right after a sync, also with
        asynchronous rollouts) as a check of the step it ran in."""
        self.add(self.trainer.step, self._weight_sync(result))

    @staticmethod
    def _weight_sync(result: dict) -> Check:
        bad = result["sync/mismatched_slices"]
        names = ", ".join(result["mismatched"])
        return Check("rollout weights equal the trainer's after a sync", bad == 0, bad, 0,
                     f"(mismatched of {result['sync/checked_slices']} slices{': ' + names if names else ''}; "
                     f"{result['sync/unverifiable_slices']} unverifiable)",
                     "the resharding plan or the rollout's kernel-format copy wrote other values than the trainer "
                     "holds (rollout.tp, resources.placement, actor layout, LoRA)")


def actor_precision(cfg) -> str:
    """'bf16' or 'fp32': what the actor (and its rollout) compute in on this machine."""
    from rlframe.workers.engines.base import precision_dtype

    dtype = precision_dtype(cfg.actor.precision, on_gpu=torch.cuda.is_available())
    return "bf16" if dtype == torch.bfloat16 else "fp32"
