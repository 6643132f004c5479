"""The critic's value head when its checkpoint has none (a critic started from a causal LM).

Every engine and every rank draws it from the same seeded generator, so an fsdp critic and a
megatron critic started from the same model dir hold the same weights, whatever else consumed
the global RNG before (nn.Linear's default range, U(-1/sqrt(hidden), 1/sqrt(hidden)))."""

from __future__ import annotations

import torch

VALUE_HEAD = ("score.weight", "score.bias")


def fresh_value_head(hidden_size: int, *, seed: int) -> dict[str, torch.Tensor]:
    """{"score.weight": (1, hidden), "score.bias": (1,)} in fp32, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    bound = hidden_size ** -0.5
    weight = (torch.rand((1, hidden_size), generator=gen) * 2 - 1) * bound
    bias = (torch.rand((1,), generator=gen) * 2 - 1) * bound
    return {"score.weight": weight, "score.bias": bias}
