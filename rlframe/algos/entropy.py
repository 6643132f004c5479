"""Token entropy of the policy, for the entropy bonus and the `actor/entropy` metric.

The bonus is `agg_loss(loss_mat=entropy, loss_mask=response_mask, loss_agg_mode=...)`, subtracted
from the policy loss with a coefficient (Mnih et al. 2016, arXiv:1602.01783; Schulman et al. 2017).
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension: (..., V) -> (...).

    H = logsumexp(z) - sum_v softmax(z)_v z_v, which needs one softmax and no log of a probability
    (a probability that underflows to 0 would give 0 * -inf = nan in -sum p log p).
    Half-precision logits are upcast to float32.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)
    # where(): a -inf logit (a banned token) has probability 0 and must add 0, not 0 * -inf.
    weighted = torch.where(probs > 0, probs * logits, torch.zeros_like(logits))
    return torch.logsumexp(logits, dim=-1) - weighted.sum(dim=-1)
