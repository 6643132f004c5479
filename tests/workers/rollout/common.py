"""Shared pieces of the rollout tests: prompts, weight perturbation, piece streams like the resharder's."""

from __future__ import annotations

import torch

from rlframe.resharding.box import Box, chunk_box


def prompt_batch(tokenizer, count: int = 16) -> dict[str, torch.Tensor]:
    """`count` left-padded prompts of different lengths (3 to 24 characters)."""
    texts = [f"{i}+{i * 7 % 13}=" * (1 + i % 4) for i in range(count)]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    assert tokenizer.padding_side == "left"
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def perturbed(state: dict[str, torch.Tensor], *, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A copy of `state` with Gaussian noise of std `scale` added (a stand-in for a large update)."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in state.items()}


def piece_buckets(state: dict[str, torch.Tensor], needed: dict[str, Box], *, parts: int = 2,
                  params_per_bucket: int = 5) -> list[list[tuple[str, Box, torch.Tensor]]]:
    """Cut every parameter's needed box into `parts` dim-0 pieces (as from `parts` source ranks) and
    group them into buckets whose boundaries fall inside parameters, like the resharding executor."""
    pieces = []
    for name, tensor in state.items():
        need = needed[name]
        for i in range(parts):
            sub = chunk_box(need.sizes, dim=0, index=i, parts=parts)
            if sub.empty:
                continue
            box = Box(tuple(o + so for o, so in zip(need.offsets, sub.offsets)), sub.sizes)
            pieces.append((name, box, tensor[box.slices()].clone()))
    step = params_per_bucket * parts - 1  # odd size: a parameter's pieces straddle buckets
    return [pieces[i:i + step] for i in range(0, len(pieces), step)]


def random_adapter(shapes: dict[str, tuple[int, int]], *, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    """Nonzero Gaussian lora_A/lora_B factors of the given shapes (B nonzero, unlike PEFT's init)."""
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in shapes.items()}


def merged_weights(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float
                   ) -> dict[str, torch.Tensor]:
    """`base` with every adapted projection replaced by W + scaling * B @ A."""
    out = dict(base)
    for name, a in adapter.items():
        if name.endswith(".lora_A.weight"):
            stem = name[: -len(".lora_A.weight")]
            out[f"{stem}.weight"] = base[f"{stem}.weight"] + scaling * adapter[f"{stem}.lora_B.weight"] @ a
    return out
