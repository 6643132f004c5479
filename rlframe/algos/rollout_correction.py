"""Corrections for tokens sampled by other weights than those the update starts from.

Three policies meet in an off-policy PPO step (asynchronous rollouts, partial rollouts continued
across updates): the behaviour policy that sampled the tokens (the rollout engine's log-probs,
`rollout_log_probs`), the proximal policy the update starts from (`old_log_probs`, the actor's
forward pass before the update, which PPO's ratio and clip are taken against) and the policy being
trained. Decoupled PPO keeps the clip around the proximal policy and corrects the gap between
behaviour and proximal with an importance weight per token, rho_t = pi_old / pi_behaviour.

What each method does with rho (its log is bounded to +-20 first, so nothing overflows):
- `tis` (decoupled PPO, token-level truncated IS): each token's advantage times min(rho_t, tis_cap);
- `seq_tis` (sequence-level truncated IS): every token of a response times min(prod_t rho_t, tis_cap);
- `icepop`: tokens with rho_t outside [low, high] are masked out of the update; the kept ones are
  weighted by rho_t (default band [0.5, 5]);
- `seq_mask_tis`: token weights min(rho_t, tis_cap), and a response whose geometric-mean ratio
  exp(mean_t log rho_t) lies outside [low, high] is masked out (default band [0.5, 2]);
- `mis` (geometric-mean masking): that mask alone, without weights;
- `rejection_kl` (with any of them, or alone with `none`): a response whose mean per-token KL from
  the behaviour to the proximal policy (the k3 estimate rho - 1 - log rho, never negative) exceeds
  the bound is masked out.

A masked token leaves the actor's update entirely, denominators included (its `response_mask` is
0 in the batch the actor receives); the critic, the metrics and the rollout dump keep the full mask.
"""

from __future__ import annotations

import torch

from rlframe.algos.masked import check_token_tensors

# algorithm.off_policy_correction: the methods, and the [low, high] band of those that mask
METHODS = ("none", "behaviour", "tis", "seq_tis", "icepop", "seq_mask_tis", "mis")
CORRECTION_BANDS = {"icepop": (0.5, 5.0), "seq_mask_tis": (0.5, 2.0), "mis": (0.5, 2.0)}


def correction_band(method: str, low: float | None, high: float | None) -> tuple[float, float]:
    """The [low, high] a masking correction keeps: the given bounds, else the method's default."""
    d_low, d_high = CORRECTION_BANDS[method]
    return (d_low if low is None else low, d_high if high is None else high)


MASKING = tuple(CORRECTION_BANDS)  # drop tokens or responses outside [low, high]
LOG_BOUND = 20.0


def correct(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, advantages: torch.Tensor,
            response_mask: torch.Tensor, *, method: str, tis_cap: float = 2.0, low: float | None = None,
            high: float | None = None, rejection_kl: float | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages, kept mask, metrics) for `method` (module doc). The kept mask is `response_mask`
    with masked tokens and responses set to 0; advantages outside it are 0."""
    check_token_tensors(response_mask=response_mask, old_log_probs=old_log_probs,
                        behaviour_log_probs=behaviour_log_probs, advantages=advantages)
    if method not in METHODS or method == "behaviour":
        raise ValueError(f"rollout correction {method!r}: expected one of {', '.join(m for m in METHODS if m != 'behaviour')}")
    valid = response_mask.bool()
    log_rho = torch.where(valid, (old_log_probs - behaviour_log_probs).clamp(-LOG_BOUND, LOG_BOUND),
                          torch.zeros_like(advantages))
    rho = torch.exp(log_rho)
    metrics = _weight_metrics(rho, valid)
    if method == "none" and rejection_kl is None:  # the weights' metrics only
        return advantages, response_mask, metrics
    lengths = valid.sum(-1)
    has = lengths > 0  # responses with a token (padding rows count in no mean)
    seq_log = log_rho.sum(-1)  # log prod_t rho_t
    geo = torch.exp(seq_log / lengths.clamp(min=1))  # geometric mean per response
    keep = valid.clone()
    weight = torch.ones_like(advantages)

    if method == "tis" or method == "seq_mask_tis":
        weight = rho.clamp(max=tis_cap)
        metrics["async/is_clipped_frac"] = _share(rho > tis_cap, valid)
    elif method == "seq_tis":
        seq_w = torch.exp(seq_log.clamp(-LOG_BOUND, LOG_BOUND))
        weight = seq_w.clamp(max=tis_cap)[:, None].expand_as(advantages)
        metrics["async/seq_is_weight_mean"] = float(seq_w[has].mean()) if has.any() else 1.0
        metrics["async/is_clipped_frac"] = _share(seq_w > tis_cap, has)
    elif method == "icepop":
        lo, hi = correction_band(method, low, high)
        keep &= (rho >= lo) & (rho <= hi)
        weight = rho
    if method in ("seq_mask_tis", "mis"):
        lo, hi = correction_band(method, low, high)
        keep &= ((geo >= lo) & (geo <= hi))[:, None]
    if rejection_kl is not None:
        k3 = torch.where(valid, rho - 1 - log_rho, torch.zeros_like(rho))
        seq_kl = k3.sum(-1) / lengths.clamp(min=1)
        rejected = (seq_kl > rejection_kl) & has
        keep &= ~rejected[:, None]
        metrics["async/behaviour_kl_mean"] = float(seq_kl[has].mean()) if has.any() else 0.0
        metrics["async/kl_rejected_frac"] = _share(rejected, has)
    if method in MASKING or rejection_kl is not None:
        metrics["async/masked_token_frac"] = _share(valid & ~keep, valid)
        metrics["async/masked_seq_frac"] = _share(~keep.any(-1), has)
        metrics["async/geo_ratio_mean"] = float(geo[has].mean()) if has.any() else 1.0
    out = torch.where(keep, advantages * weight, torch.zeros_like(advantages))
    return out, keep.to(response_mask.dtype), metrics


def _weight_metrics(rho: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    if not valid.any():
        return {"async/is_weight_mean": 1.0, "async/is_weight_max": 1.0}
    return {"async/is_weight_mean": float(rho[valid].mean()), "async/is_weight_max": float(rho[valid].max())}


def _share(flags: torch.Tensor, valid: torch.Tensor) -> float:
    return float(flags[valid].float().mean()) if valid.any() else 0.0
