"""Clipped policy-gradient losses: PPO (with asymmetric clip-higher), dual-clip PPO and GSPO.

Every policy loss has the same keyword-only signature, so the actor can call any by name
(`get_policy_loss(name)`):

    fn(*, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None,
       global_token_count=None, global_seq_count=None, loss_scale_factor=None) -> (loss, metrics)

    old_log_prob (B, R): log pi_old(y_t) of the policy that sampled (no gradient needed).
    log_prob     (B, R): log pi_theta(y_t) of the policy being trained (carries the gradient).
    advantages   (B, R), response_mask (B, R).
    loss: scalar, aggregated by `loss_agg_mode` (see aggregation.py; the global_* counts make
          micro-batch losses sum to the mini-batch loss).
    metrics: detached scalar tensors (no device sync here; the worker converts them):
        pg_clipfrac: fraction of valid tokens whose loss the clipped term decides,
        ppo_kl: mean over valid tokens of log pi_old - log pi_theta (the k1 estimate of KL(old||new)),
        pg_clipfrac_lower: fraction of valid tokens that the dual-clip bound decides (0 otherwise).

Clip-higher (DAPO, Yu et al. 2025, arXiv:2503.14476) is not a separate name: it is "ppo" with
clip_ratio_high > clip_ratio_low (e.g. 0.28 and 0.2). One function with two bounds is the general
case, and a second name would only invite configs where the two disagree.
Log-ratios are clamped to [-20, 20] before exp so a stale old_log_prob cannot overflow the ratio.
"""

from __future__ import annotations

import torch

from rlframe.algos.aggregation import agg_loss
from rlframe.algos.masked import check_token_tensors, masked_mean
from rlframe.algos.registry import register_policy_loss

_LOG_RATIO_CLAMP = 20.0


def _check_clip(*, clip_ratio_low, clip_ratio_high, name):
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"{name}: clip_ratio_low must be in [0, 1) so that 1 - clip_ratio_low > 0, got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ValueError(f"{name}: clip_ratio_high must be >= 0, got {clip_ratio_high}")


def _clipped_surrogate(*, ratio, advantages, clip_ratio_low, clip_ratio_high):
    """Per-token max(-A r, -A clip(r, 1-eps_low, 1+eps_high)) and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _finish(*, loss_mat, response_mask, log_ratio, clip_active, lower_active, agg_kwargs):
    loss = agg_loss(loss_mat=loss_mat, loss_mask=response_mask, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(clip_active.to(loss_mat.dtype), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "pg_clipfrac_lower": masked_mean(lower_active.to(loss_mat.dtype), response_mask),
        }
    return loss, metrics


def _checked_surrogate(*, old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, name):
    """Validate the inputs of a token-level clipped loss; return (log_ratio, loss_mat, clip_active)."""
    _check_clip(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, name=name)
    check_token_tensors(response_mask=response_mask, old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages)
    log_ratio = _token_log_ratio(log_prob, old_log_prob)
    loss_mat, clip_active = _clipped_surrogate(ratio=torch.exp(log_ratio), advantages=advantages,
                                               clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high)
    return log_ratio, loss_mat, clip_active


def _token_log_ratio(log_prob, old_log_prob):
    return torch.clamp(log_prob - old_log_prob.detach(), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


@register_policy_loss("ppo")
@register_policy_loss("vanilla")
def ppo_loss(*, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
             clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None,
             global_token_count=None, global_seq_count=None, loss_scale_factor=None):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), token-level.

    L_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)),
    r_t = pi_theta(y_t) / pi_old(y_t). clip_ratio_high > clip_ratio_low is DAPO's clip-higher.
    clip_ratio_c must be None (use "dual_clip" for the lower bound). Shapes (B, R) -> scalar.
    """
    if clip_ratio_c is not None:
        raise ValueError(
            f"policy loss 'ppo' got clip_ratio_c={clip_ratio_c}, which only the dual-clip loss uses; "
            f"set policy_loss to 'dual_clip' or clip_ratio_c to None"
        )
    log_ratio, loss_mat, clip_active = _checked_surrogate(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, name="ppo")
    return _finish(
        loss_mat=loss_mat, response_mask=response_mask, log_ratio=log_ratio, clip_active=clip_active,
        lower_active=torch.zeros_like(clip_active),
        agg_kwargs=dict(loss_agg_mode=loss_agg_mode, global_token_count=global_token_count,
                        global_seq_count=global_seq_count, loss_scale_factor=loss_scale_factor),
    )


@register_policy_loss("dual_clip")
def dual_clip_loss(*, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                   clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                   global_token_count=None, global_seq_count=None, loss_scale_factor=None):
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL",
    arXiv:1912.09729): for A_t < 0 the loss is also bounded by -c A_t, so a huge ratio on a bad
    action cannot produce an unbounded update.

    L_t = min(L_t^ppo, -c A_t) if A_t < 0 else L_t^ppo, with c = clip_ratio_c > 1.
    Shapes (B, R) -> scalar; metrics add pg_clipfrac_lower (tokens where the -c A bound won).
    """
    if clip_ratio_c is None or clip_ratio_c <= 1.0:
        raise ValueError(
            f"dual_clip needs clip_ratio_c > 1 (the lower bound is -clip_ratio_c * A for A < 0; 3.0 is "
            f"the usual value), got {clip_ratio_c}"
        )
    log_ratio, ppo_mat, clip_active = _checked_surrogate(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, name="dual_clip")
    bound = -advantages * clip_ratio_c
    lower_active = (advantages < 0) & (ppo_mat > bound)
    loss_mat = torch.where(lower_active, bound, ppo_mat)
    return _finish(
        loss_mat=loss_mat, response_mask=response_mask, log_ratio=log_ratio, clip_active=clip_active,
        lower_active=lower_active,
        agg_kwargs=dict(loss_agg_mode=loss_agg_mode, global_token_count=global_token_count,
                        global_seq_count=global_seq_count, loss_scale_factor=loss_scale_factor),
    )


@register_policy_loss("gspo")
def gspo_loss(*, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
              clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_c=None,
              global_token_count=None, global_seq_count=None, loss_scale_factor=None):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071).

    The importance ratio is per sequence, s_i = exp(mean_t (log pi_theta - log pi_old)) over the
    valid tokens, and it is clipped per sequence. Written in the paper's GSPO-token form,
    s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)], whose value is s_i on every token and
    whose gradient, with equal advantages over a sequence and loss_agg_mode
    "seq-mean-token-mean" (the paper's objective, and the default here), equals sequence-level GSPO's.
    A run with `algorithm.loss_agg_mode` unset uses this default (`resolve_loss_agg_mode`); an explicit
    value, e.g. token-mean (verl's default for every loss), still wins.
    The paper's clip ranges are tiny (3e-4 / 4e-4) because the ratio is a length-normalized mean.
    clip_ratio_c must be None. Shapes (B, R) -> scalar.
    """
    if clip_ratio_c is not None:
        raise ValueError(f"gspo does not use clip_ratio_c (got {clip_ratio_c}); set it to None")
    _check_clip(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, name="gspo")
    check_token_tensors(response_mask=response_mask, old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages)
    token_log_ratio = _token_log_ratio(log_prob, old_log_prob)
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1)  # (B,), 0 for empty rows
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    log_ratio = torch.clamp(log_ratio, max=_LOG_RATIO_CLAMP)
    loss_mat, clip_active = _clipped_surrogate(
        ratio=torch.exp(log_ratio), advantages=advantages,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
    )
    return _finish(
        loss_mat=loss_mat, response_mask=response_mask, log_ratio=token_log_ratio, clip_active=clip_active,
        lower_active=torch.zeros_like(clip_active),
        agg_kwargs=dict(loss_agg_mode=loss_agg_mode, global_token_count=global_token_count,
                        global_seq_count=global_seq_count, loss_scale_factor=loss_scale_factor),
    )
