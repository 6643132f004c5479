"""Gradient accumulation bookkeeping every backend shares: per-micro-batch loss weights and the
global reduction of the metrics a step reports.

Backends average gradients over dp (FSDP2's reduce-scatter, Megatron DDP's all-reduce). With the
weights below, `sum_micro_batches(loss * weight)` then yields the gradient of one big batch:
with "tokens" a micro-batch's mean-per-token loss counts in proportion to its response tokens out
of all response tokens of all micro-batches of all dp ranks (so 1 x 8 == 8 x 1 and dp2 == dp1);
"samples" weights by samples; "none" sums the losses as given; "global" sums them too and gives the
loss function the mini-batch's global counts to normalise by (`attach_global_counts`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from rlframe.workers.engines.base import LOSS_WEIGHTINGS, require_keys
from rlframe.workers.engines.micro_batch import MicroBatch

TOKEN_STATS = ("tokens_valid", "tokens_computed", "tokens_padded")


def micro_batch_weights(mbs: list[MicroBatch], loss_weighting: str, *, dp: int, dp_group,
                        device: torch.device, allow_empty: bool = False) -> list[float] | None:
    """Per micro-batch loss multipliers; with the backend's dp average they give one global mean.
    A mini-batch without a response token on any dp rank is an error, or, with `allow_empty` (an
    off-policy correction dropped every token of it), None: the caller skips the step."""
    if loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss_weighting {loss_weighting!r} is unknown; use one of {LOSS_WEIGHTINGS}")
    if loss_weighting == "none":
        return [dp * mb.weight_scale for mb in mbs]
    if loss_weighting == "global":
        if not attach_global_counts(mbs, dp=dp, dp_group=dp_group, device=device, allow_empty=allow_empty):
            return None
        return [dp * mb.weight_scale for mb in mbs]
    if loss_weighting == "tokens":
        require_keys(mbs[0].data, ("response_mask",), what="loss_weighting='tokens'")
        units = [float(mb.data["response_mask"].sum()) * mb.weight_scale for mb in mbs]
    else:
        units = [float(mb.size) * mb.weight_scale for mb in mbs]
    total = torch.tensor([sum(units)], dtype=torch.float64, device=device)
    if dp > 1:
        dist.all_reduce(total, group=dp_group)
    if float(total) <= 0:
        if allow_empty:
            return None
        raise ValueError(f"loss_weighting={loss_weighting!r}: the batch has no response tokens/samples to weight")
    return [u * dp / float(total) for u in units]


def attach_global_counts(mbs: list[MicroBatch], *, dp: int, dp_group, device: torch.device,
                         allow_empty: bool = False) -> bool:
    """Put the mini-batch's valid response tokens and non-empty rows, over every micro-batch of every
    dp rank (padding micro-batches excluded), into each micro-batch as 0-d tensors
    `global_token_count` and `global_seq_count`: a loss normalised by them, summed over the
    micro-batches, is the loss of the whole mini-batch computed at once (loss_weighting "global").
    False when there is no token (allowed with `allow_empty`, else an error)."""
    require_keys(mbs[0].data, ("response_mask",), what="loss_weighting='global'")
    local = torch.zeros(2, dtype=torch.float64)
    for mb in mbs:
        if mb.weight_scale:
            mask = mb.data["response_mask"].detach().cpu()
            local += torch.tensor([float(mask.sum()), float((mask.sum(-1) > 0).sum())], dtype=torch.float64)
    local = local.to(device)
    if dp > 1:
        dist.all_reduce(local, group=dp_group)
    tokens, seqs = (float(v) for v in local.cpu())
    if tokens <= 0:
        if allow_empty:
            return False
        raise ValueError("loss_weighting='global': the mini-batch has no response tokens to normalise by")
    for mb in mbs:
        mb.data["global_token_count"] = torch.tensor(tokens, dtype=torch.float32, device=device)
        mb.data["global_seq_count"] = torch.tensor(seqs, dtype=torch.float32, device=device)
    return True


def empty_step(lr: float) -> dict[str, float]:
    """What `train_step` reports for a mini-batch it skipped (`allow_empty`, no token left): no
    gradient, no optimizer or scheduler step (AdamW would still move the weights by its moments)."""
    return {"grad_norm": 0.0, "lr": lr, "skipped": 0.0, "empty": 1.0}


def check_scalar_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar tensor as its loss, got {type(loss).__name__} "
                         f"{getattr(loss, 'shape', '')}")


class MetricSums:
    """Weighted sums of a step's metrics and token counts, over this rank's micro-batches."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens = dict.fromkeys(TOKEN_STATS, 0)

    def add(self, loss: torch.Tensor, metrics: Mapping[str, Any], weight: float, stats: Mapping[str, int],
            weight_scale: float) -> None:
        for k, v in {"loss": loss, **dict(metrics)}.items():
            self.sums[k] = self.sums.get(k, 0.0) + torch.as_tensor(v, dtype=torch.float64).detach().cpu() * weight
        if weight_scale:  # padding micro-batches (weight 0) do not count as work
            self.tokens = {k: self.tokens[k] + int(stats[k]) for k in TOKEN_STATS}

    def reduce(self, *, dp: int, dp_group, device: torch.device) -> dict[str, float]:
        """Global values (all-reduced over dp; identical over tp)."""
        keys = sorted(self.sums) + list(TOKEN_STATS)
        # Metric sums carry weight dp / total each; dividing by dp turns the dp-sum into the mean.
        vec = torch.stack([self.sums[k].double() / dp for k in sorted(self.sums)]
                          + [torch.tensor(float(self.tokens[k]), dtype=torch.float64) for k in TOKEN_STATS])
        vec = vec.to(device)
        if dp > 1:
            dist.all_reduce(vec, group=dp_group)
        return {k: float(v) for k, v in zip(keys, vec.cpu().tolist())}
