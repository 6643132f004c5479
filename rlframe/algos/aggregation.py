"""Loss aggregation: how a (B, R) per-token loss becomes one scalar.

The choice matters for RL on language models: averaging per sequence first gives every response
the same weight whatever its length (GRPO, Shao et al. 2024), which biases against long wrong
answers; averaging over all tokens gives every token the same weight (DAPO, Yu et al. 2025);
summing per sequence and dividing by a constant removes the length bias altogether (Dr. GRPO,
Liu et al. 2025, "Understanding R1-Zero-Like Training").

Modes (registered by name, `get_loss_agg_mode(name)`):
- `token-mean`: sum over all valid tokens / number of valid tokens.
- `seq-mean-token-sum`: per-sequence token sum, then mean over sequences.
- `seq-mean-token-mean`: per-sequence token mean, then mean over sequences.
- `seq-mean-token-sum-norm`: per-sequence token sum / `loss_scale_factor`, then mean over sequences.
  The constant must not depend on the batch: a run passes `data.response_length`, the maximum
  response length (`algorithm.loss_scale_factor` overrides it). Called without one, R (the padded
  length of the tensor given) stands in, which varies with each micro-batch's padding.
  (verl divides the batch sum by R without the mean over sequences; here the mean over sequences
  keeps the scale independent of the batch size, like the other modes.)

Rows with no valid token (padding rows) count in no denominator. When nothing is valid the loss is
0 and still connected to the graph, so backward gives zero gradients instead of nan.

Gradient accumulation: a mini-batch split into micro-batches gives the same gradient as the whole
mini-batch when each micro-batch loss is computed with the mini-batch's counts
(`global_token_count` for token-mean, `global_seq_count` for the seq-mean modes) and the micro
losses are summed. Without them each micro-batch is normalized by its own counts.
"""

from __future__ import annotations

import torch

from rlframe.algos.masked import as_float_mask, masked_sum
from rlframe.algos.registry import get_loss_agg_mode, register_loss_agg_mode


def _zero_like_graph(loss_mat: torch.Tensor) -> torch.Tensor:
    # A zero that still depends on loss_mat, so callers can always call backward().
    return torch.where(torch.isfinite(loss_mat), loss_mat, torch.zeros_like(loss_mat)).sum() * 0.0


def _seq_denominator(loss_mask: torch.Tensor, global_seq_count: int | float | None) -> torch.Tensor | float:
    if global_seq_count is not None:
        return float(global_seq_count)
    return (loss_mask.sum(dim=-1) > 0).sum().clamp(min=1)


@register_loss_agg_mode("token-mean")
def token_mean(*, loss_mat, loss_mask, global_token_count=None, global_seq_count=None, loss_scale_factor=None):
    """Sum over valid tokens / (number of valid tokens, or `global_token_count`). Shapes (B, R) -> ()."""
    if global_token_count is None and not loss_mask.any():
        return _zero_like_graph(loss_mat)
    denom = float(global_token_count) if global_token_count is not None else as_float_mask(loss_mask, loss_mat).sum()
    return masked_sum(loss_mat, loss_mask) / denom


@register_loss_agg_mode("seq-mean-token-sum")
def seq_mean_token_sum(*, loss_mat, loss_mask, global_token_count=None, global_seq_count=None, loss_scale_factor=None):
    """Mean over non-empty sequences of the token sum. Shapes (B, R) -> ()."""
    if global_seq_count is None and not loss_mask.any():
        return _zero_like_graph(loss_mat)
    return masked_sum(loss_mat, loss_mask, dim=-1).sum() / _seq_denominator(loss_mask, global_seq_count)


@register_loss_agg_mode("seq-mean-token-mean")
def seq_mean_token_mean(*, loss_mat, loss_mask, global_token_count=None, global_seq_count=None, loss_scale_factor=None):
    """Mean over non-empty sequences of the token mean. Shapes (B, R) -> ()."""
    if global_seq_count is None and not loss_mask.any():
        return _zero_like_graph(loss_mat)
    lengths = as_float_mask(loss_mask, loss_mat).sum(dim=-1).clamp(min=1)
    seq_means = masked_sum(loss_mat, loss_mask, dim=-1) / lengths
    return seq_means.sum() / _seq_denominator(loss_mask, global_seq_count)


@register_loss_agg_mode("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(*, loss_mat, loss_mask, global_token_count=None, global_seq_count=None, loss_scale_factor=None):
    """Mean over non-empty sequences of token sum / loss_scale_factor (default R). (B, R) -> ()."""
    if global_seq_count is None and not loss_mask.any():
        return _zero_like_graph(loss_mat)
    scale = float(loss_scale_factor) if loss_scale_factor is not None else float(loss_mat.shape[-1])
    if scale <= 0:
        raise ValueError(f"loss_scale_factor must be > 0 (a constant such as the max response length), got {scale}")
    seq = masked_sum(loss_mat, loss_mask, dim=-1) / scale
    return seq.sum() / _seq_denominator(loss_mask, global_seq_count)


def agg_loss(
    *,
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    global_token_count: int | float | None = None,
    global_seq_count: int | float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a (B, R) per-token loss into a scalar with the named mode (see module docstring).

    Also the way to aggregate an entropy bonus or a KL loss: `agg_loss(loss_mat=entropy, ...)`.
    """
    if tuple(loss_mat.shape) != tuple(loss_mask.shape) or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must both be (B, R)"
        )
    fn = get_loss_agg_mode(loss_agg_mode)
    return fn(
        loss_mat=loss_mat,
        loss_mask=loss_mask,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        loss_scale_factor=loss_scale_factor,
    )
