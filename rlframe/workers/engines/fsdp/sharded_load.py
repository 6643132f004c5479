"""Give a model built on the meta device (modeling.empty_model), once tensor parallelism and FSDP2 have
sharded it, storage for this rank's shards only, and fill them.

Each parameter is a DTensor (or, on one rank, a plain tensor) whose local tensor is one Box of the
global tensor (shards.py). `load_shards` allocates the local tensors on the device (`to_empty`) and
copies into each the same Box of the tensor it starts from:
- the checkpoint's tensor of the same HF name, read one slice at a time (hf_weights.iter_slices), so a
  rank's peak is its shards plus one slice being read, never the whole model;
- a LoRA adapter: what `LoraLinear` drew for it from the seed (lora.py; identical on every rank);
- the critic's `score` when the checkpoint (a causal LM) has none: `fresh_value_head(seed)`.
Tied weights are one parameter (the embedding), filled once. Buffers were computed from the config
on CPU when the model was built (rotary frequencies); `to_empty` would leave them uninitialised, so
they are put back after it. The values are those a full `from_pretrained` load gives, bit for bit:
a slice of a tensor is the same numbers, and fp32 is the dtype of both (bf16 checkpoints upcast exactly).
"""

from __future__ import annotations

import torch
from torch import nn

from rlframe.workers.engines.fsdp.shards import local_shards
from rlframe.workers.engines.hf_weights import iter_slices
from rlframe.workers.engines.value_head import VALUE_HEAD, fresh_value_head


def _initial_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> the full initial value of every LoRA adapter of a model built on meta; the
    modules drop their copy (it was only kept for this)."""
    from rlframe.workers.engines.lora import LoraLinear

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear) and m.initial is not None:
            out.update({f"{name}.{k}": v for k, v in m.initial.items()})
            m.initial = None
    return out


@torch.no_grad()
def load_shards(model: nn.Module, *, model_path: str, device: torch.device, seed: int) -> None:
    """Materialise `model`'s (sharded, meta-device) parameters on `device` and fill them; see the
    module docstring. Raises ValueError naming the parameters the checkpoint lacks."""
    buffers = {name: b.detach().to("cpu", copy=True) for name, b in model.named_buffers()}
    meta_buffers = [name for name, b in buffers.items() if b.is_meta]
    if meta_buffers:
        raise AssertionError(f"buffers {meta_buffers[:5]} have no values to restore after to_empty")
    adapters = _initial_adapters(model)
    model.to_empty(device=device)
    for name, value in buffers.items():
        model.get_buffer(name).copy_(value)

    shards = local_shards(model)  # HF name -> (global shape, Box, local tensor)
    pending = set(shards)

    def fill(values):
        for name, value in values:
            _, box, local = shards[name]
            if tuple(value.shape) != box.sizes:
                raise AssertionError(f"{name}: slice {tuple(value.shape)} != local shard {box}")
            local.copy_(value)
            pending.discard(name)

    fill(_boxes_of(adapters, shards))
    fill(iter_slices(model_path, {n: shards[n][:2] for n in pending}))
    head = fresh_value_head(model.config.hidden_size, seed=seed) if pending & set(VALUE_HEAD) else {}
    fill(_boxes_of({n: t for n, t in head.items() if n in pending}, shards))
    if pending:
        raise ValueError(f"{model_path!r} lacks parameters {sorted(pending)[:5]} (of {len(pending)}) that the "
                         f"{type(model).__name__} built from its config.json has; is config.json the one the "
                         "weights were saved with?")


def _boxes_of(full: dict[str, torch.Tensor], shards):
    """(name, this rank's Box of the full tensor) for each of `full`."""
    for name, t in full.items():
        shape, box, _ = shards[name]
        if tuple(t.shape) != tuple(shape):
            raise AssertionError(f"{name}: initial value {tuple(t.shape)} != parameter {shape}")
        yield name, t[box.slices()]
