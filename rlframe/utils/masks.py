"""Position ids from an attention mask, as every batch of docs/contracts.md defines them."""

from __future__ import annotations


def position_ids_from_mask(attention_mask):
    """(B, T) mask -> (B, T) positions: clamp(cumsum(mask) - 1, min=0), so the first real token of a
    left-padded row is at 0 and padding repeats position 0."""
    import torch

    return torch.clamp(attention_mask.cumsum(dim=1) - 1, min=0)
