"""Rejection-sampling fine-tuning (RAFT, Dong et al. 2023, arXiv:2304.06767), added without editing
rlframe: sample n responses per prompt, keep the best one of each prompt when it is correct, and
fine-tune on the kept ones (a likelihood step, no ratio, no clipping).

What this file adds, and how each plugs in:
- `rft_best_of_n`, an advantage estimator registered by name: 1 on every token of the best correct
  sample of each group, 0 elsewhere;
- `weighted_nll`, a policy loss registered by name: mean of -A * log pi over response tokens;
- `RFTActorWorker`, a subclass of the actor worker with one new registered method,
  `response_nll` (per-sample NLL of the responses under the current policy, for the metrics);
- `RFTTrainer`, a subclass of the PPO trainer whose step is the RAFT dataflow.
`rft_tiny.yaml` selects them: `imports:` (registers the estimator and loss in the driver and in every
worker), `algorithm.trainer`, `actor.worker_cls`, `algorithm.adv_estimator`, `algorithm.policy_loss`.

    python -m rlframe.main --config-path examples/custom_algorithm --config-name rft_tiny
"""

from __future__ import annotations

import torch

from rlframe.algos import agg_loss, register_advantage_estimator, register_policy_loss
from rlframe.algos.grouping import group_rows
from rlframe.single_controller import Dispatch, register
from rlframe.controller.trainers import phases
from rlframe.controller.trainers.metrics import batch_metrics, gathered, throughput
from rlframe.controller.trainers.ppo import PPOTrainer
from rlframe.protocol import DataProto
from rlframe.utils.timing import timed
from rlframe.workers.actor import ActorWorker

ACCEPT_SCORE = 1.0  # a response is accepted when its reward reaches this (a correct answer)


@register_advantage_estimator("rft_best_of_n")
def rft_best_of_n(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
                  gamma=1.0, lam=1.0, epsilon=1e-6):
    """(B, R) rewards -> (B, R) advantages: 1 on the best accepted sample of each group, else 0."""
    if index is None:
        raise ValueError("rft_best_of_n picks the best sample per prompt: the batch needs its `uid` groups")
    scores = (token_level_rewards * response_mask).sum(-1)  # (B,)
    groups = group_rows(index, batch_size=scores.shape[0])
    best = torch.zeros_like(scores)
    for g in range(len(groups.ids)):
        members = torch.nonzero(groups.inverse == g).squeeze(-1)
        top = members[torch.argmax(scores[members])]
        if scores[top] >= ACCEPT_SCORE:
            best[top] = 1.0
    adv = best.unsqueeze(-1) * response_mask
    return adv, adv


@register_policy_loss("weighted_nll")
def weighted_nll(*, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                 clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None, global_token_count=None,
                 global_seq_count=None, loss_scale_factor=None):
    """Supervised step on the accepted samples: agg(-A * log pi) (old_log_prob is not used)."""
    loss = agg_loss(loss_mat=-advantages * log_prob, loss_mask=response_mask * (advantages > 0),
                    loss_agg_mode=loss_agg_mode, global_token_count=global_token_count,
                    global_seq_count=global_seq_count, loss_scale_factor=loss_scale_factor)
    return loss, {"accepted_tokens": (advantages > 0).float().sum().detach()}


class RFTActorWorker(ActorWorker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def response_nll(self, data: DataProto) -> DataProto:
        """Per-sample mean negative log-likelihood (B,) of the responses under the current policy."""
        lp = self.engine.forward_log_probs(data)["log_probs"]
        mask = data.batch["response_mask"].float()
        return DataProto.from_dict(tensors={"nll": -(lp * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)})


class RFTTrainer(PPOTrainer):
    """prompts -> n samples -> score -> keep best correct per prompt -> likelihood step on them."""

    def train_step(self) -> dict:
        t: dict[str, float] = {}
        with timed(t, "step"):
            with timed(t, "gen"):
                batch, gen_m = self.rollout(self.next_prompts())
            with timed(t, "reward"):
                batch, reward_m = self.score(batch)
            with timed(t, "adv"):
                batch, _ = phases.advantages(batch, cfg=self.cfg, kl_ctrl=self.kl_ctrl)
            batch = batch.union(DataProto.from_dict(tensors={"old_log_probs": batch.batch["rollout_log_probs"]}))
            accepted = batch.batch["advantages"].sum(-1) > 0
            m = {"rft/accept_ratio": float(accepted.float().mean())}
            with timed(t, "response_nll"):
                nll = self.roles.actor.response_nll(batch).batch["nll"]
            if accepted.any():
                m["rft/accepted_nll_before"] = float(nll[accepted].mean())
            batch.meta_info = self.step_meta()
            with timed(t, "update_actor"):
                m.update(gathered(self.roles.actor.update_actor(batch)))
            if accepted.any():  # the step should make the accepted answers more likely
                after = self.roles.actor.response_nll(batch).batch["nll"]
                m["rft/accepted_nll_after"] = float(after[accepted].mean())
        t["timing_s/update_weights"] = gen_m.pop("timing_s/update_weights", 0.0)
        return {**m, **gen_m, **reward_m, **t, **batch_metrics(batch, response_length=self.cfg.data.response_length,
                                                               end_ids=self.end_ids),
                **throughput(batch, step_time=t["timing_s/step"], world_size=self.roles.actor.world_size)}
