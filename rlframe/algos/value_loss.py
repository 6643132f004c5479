"""Critic loss: squared error to the returns, with PPO's value clipping."""

from __future__ import annotations

import torch

from rlframe.algos.aggregation import agg_loss
from rlframe.algos.masked import check_token_tensors, masked_mean


def compute_value_loss(
    *,
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    global_token_count: int | float | None = None,
    global_seq_count: int | float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of PPO implementations (Schulman et al. 2017, arXiv:1707.06347; OpenAI
    baselines ppo2): the new prediction may not move the loss below what a prediction within
    `cliprange_value` of the old value would give.

    L_t = 0.5 * max((V_t - G_t)^2, (clip(V_t, V_old - c, V_old + c) - G_t)^2);
    with cliprange_value None, L_t = 0.5 * (V_t - G_t)^2.

    Args:
        vpreds (B, R): the critic's current predictions (carry the gradient).
        values (B, R): the predictions when the batch was collected (V_old).
        returns (B, R): regression targets (from the advantage estimator).
        response_mask (B, R), loss_agg_mode and the global_* counts: as in `agg_loss`.
    Returns:
        (loss scalar, metrics) with metrics["vf_clipfrac"], the fraction of valid tokens whose loss
        the clipped prediction decides, as a detached scalar tensor.
    """
    check_token_tensors(response_mask=response_mask, vpreds=vpreds, values=values, returns=returns)
    unclipped = (vpreds - returns) ** 2
    if cliprange_value is None:
        loss_mat, clip_active = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        if cliprange_value < 0:
            raise ValueError(f"cliprange_value must be >= 0 or None (no clipping), got {cliprange_value}")
        # clamp the prediction itself: inside the range it is then vpreds bit for bit (values + clamp(
        # vpreds - values) differs from vpreds by a rounding step and counted unclipped tokens as clipped)
        vclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        clipped = (vclipped - returns) ** 2
        loss_mat, clip_active = torch.maximum(unclipped, clipped), clipped > unclipped
    loss = 0.5 * agg_loss(
        loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
        global_token_count=global_token_count, global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean(clip_active.to(loss_mat.dtype), response_mask)}
    return loss, metrics
