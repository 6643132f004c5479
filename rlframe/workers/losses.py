"""Loss closures the roles hand to their training engine: `loss_fn(outputs, micro_batch)`.

The engine knows nothing of RL; these adapt `rlframe.algos` to its interface. `outputs` holds
`log_probs` (and `entropy`) (b, R) for the actor, `values` (b, R) for the critic; the micro-batch
holds the batch keys of docs/contracts.md.
"""

from __future__ import annotations

import torch

from rlframe.algos import agg_loss, compute_value_loss, get_policy_loss, resolve_loss_agg_mode
from rlframe.algos.kl import compute_kl_loss
from rlframe.algos.preference import online_dpo_loss
from rlframe.config.schema import AlgorithmConfig


def actor_loss_fn(algo: AlgorithmConfig, *, loss_scale_factor: float | None = None):
    """Policy loss (+ entropy bonus, + KL-to-reference loss when configured)."""
    policy_loss = get_policy_loss(algo.policy_loss)
    agg_mode = resolve_loss_agg_mode(policy_loss=algo.policy_loss, loss_agg_mode=algo.loss_agg_mode)
    if loss_scale_factor is None:  # seq-mean-token-sum-norm's constant (the driver sets the max response length)
        loss_scale_factor = algo.loss_scale_factor
    clip_c = algo.clip_ratio_c if algo.policy_loss == "dual_clip" else None

    def loss_fn(outputs, mb):
        mask = mb["response_mask"]
        log_prob = outputs["log_probs"]
        pg_loss, m = policy_loss(
            old_log_prob=mb["old_log_probs"], log_prob=log_prob, advantages=mb["advantages"],
            response_mask=mask, loss_agg_mode=agg_mode, clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high, clip_ratio_c=clip_c, loss_scale_factor=loss_scale_factor,
        )
        loss = pg_loss
        metrics = {"actor/pg_loss": pg_loss.detach(), **{f"actor/{k}": v for k, v in m.items()}}
        if "entropy" in outputs:
            entropy = agg_loss(loss_mat=outputs["entropy"], loss_mask=mask, loss_agg_mode="token-mean")
            metrics["actor/entropy"] = entropy.detach()
            if algo.entropy_coef:
                loss = loss - algo.entropy_coef * entropy
        if algo.use_kl_loss:
            kl = compute_kl_loss(log_prob=log_prob, ref_log_prob=mb["ref_log_prob"], response_mask=mask,
                                 estimator=algo.kl_loss_estimator, loss_agg_mode=agg_mode,
                                 loss_scale_factor=loss_scale_factor)
            loss = loss + algo.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        return loss, metrics

    return loss_fn


def critic_loss_fn(*, cliprange_value: float, loss_agg_mode: str):
    def loss_fn(outputs, mb):
        loss, m = compute_value_loss(
            vpreds=outputs["values"], values=mb["values"], returns=mb["returns"],
            response_mask=mb["response_mask"], cliprange_value=cliprange_value, loss_agg_mode=loss_agg_mode,
        )
        return loss, {"critic/vf_loss": loss.detach(), **{f"critic/{k}": v for k, v in m.items()}}

    return loss_fn


def dpo_loss_fn(*, beta: float):
    """Online DPO on a micro-batch whose rows alternate (chosen, rejected) of the same prompt."""

    def loss_fn(outputs, mb):
        lp, ref, mask = outputs["log_probs"], mb["ref_log_prob"], mb["response_mask"]
        if lp.shape[0] % 2:
            raise ValueError(f"online DPO micro-batch has {lp.shape[0]} rows; rows must come in (chosen, rejected) pairs")
        loss, m = online_dpo_loss(
            chosen_log_prob=lp[0::2], rejected_log_prob=lp[1::2], ref_chosen_log_prob=ref[0::2],
            ref_rejected_log_prob=ref[1::2], chosen_mask=mask[0::2], rejected_mask=mask[1::2], beta=beta,
        )
        return loss, {"actor/dpo_loss": loss.detach(), **{f"actor/dpo_{k}": torch.as_tensor(v) for k, v in m.items()}}

    return loss_fn


def sft_loss_fn():
    """Supervised fine-tuning: mean negative log-likelihood of the response tokens."""

    def loss_fn(outputs, mb):
        mask = mb["response_mask"].to(outputs["log_probs"].dtype)
        nll = -(outputs["log_probs"] * mask).sum() / mask.sum().clamp(min=1.0)
        return nll, {"sft/nll": nll.detach()}

    return loss_fn
