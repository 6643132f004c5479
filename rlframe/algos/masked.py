"""Masked reductions over token-level tensors, and the shape checks every algorithm shares.

Token-level tensors are (B, R): B responses, right-padded to R tokens; `response_mask` (B, R) is 1
on the tokens that count (int, bool or float are all accepted). Reductions treat masked-out
entries as absent, never as zeros, so padding changes nothing.
"""

from __future__ import annotations

import torch


def as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`mask` as 0/1 in the dtype and device of `like` (masks arrive as int64, bool or float)."""
    return mask.to(device=like.device, dtype=like.dtype)


def check_token_tensors(*, response_mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """ValueError naming the offending argument unless every given tensor is (B, R) like the mask."""
    if response_mask.dim() != 2:
        raise ValueError(
            f"response_mask must be (B, R) = (batch, response length), got shape {tuple(response_mask.shape)}"
        )
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != tuple(response_mask.shape):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but response_mask has {tuple(response_mask.shape)}; "
                f"token-level tensors must all be (B, R) and aligned with response_mask"
            )


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over the entries where mask is 1 (over everything when dim is None)."""
    m = as_float_mask(mask, x)
    # where() rather than x * m: padded entries may hold inf/nan (e.g. log-probs of pad tokens).
    xm = torch.where(m.bool(), x, torch.zeros_like(x))
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the entries where mask is 1; 0 where there are none (not nan)."""
    count = as_float_mask(mask, x).sum() if dim is None else as_float_mask(mask, x).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased (Bessel-corrected) variance of the masked entries of x, over all of them.

    With one valid entry the variance is 0 (the divisor is clamped to 1) rather than nan.
    """
    m = as_float_mask(mask, x)
    mean = masked_mean(x, mask)
    count = m.sum()
    return masked_sum((x - mean) ** 2, mask) / (count - 1).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, epsilon: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + epsilon) over the masked entries of the whole tensor; 0 off the mask.

    This is the batch-level normalization of PPO implementations and REINFORCE++: statistics are
    taken over every valid token of the batch, not per sequence.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + epsilon)
    return torch.where(as_float_mask(mask, x).bool(), out, torch.zeros_like(out))


def sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) outcome reward of each response: the sum of its token-level rewards on the mask.

    Outcome rewards sit on the last response token, so this is that reward (plus any per-token
    terms, e.g. a KL penalty, when the caller put them in the reward).
    """
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def reverse_discounted_cumsum(x: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """(B, R) return-to-go G_t = x_t + gamma * G_{t'} over the masked tokens only (t' = next valid).

    Masked-out positions are skipped (they neither add reward nor discount) and get G = 0.
    """
    m = as_float_mask(mask, x)
    valid = m.bool()
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[:, 0])
    for t in reversed(range(x.shape[1])):
        running = torch.where(valid[:, t], x[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return out
