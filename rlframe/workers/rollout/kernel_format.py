"""The default weight-sync path: this rank's HF shards -> vLLM kernel-format tensors, copied in place.

vLLM's unquantised linear layers keep the checkpoint's (out, in) layout, fused per TP rank:
`self_attn.qkv_proj` = cat(q_shard, k_shard, v_shard) and `mlp.gate_up_proj` = cat(gate_shard,
up_shard) on dim 0 (biases alike); embed_tokens/lm_head hold the rank's rows of the vocabulary
padded to a multiple of 64, so the received rows fill the parameter's leading rows. Copying into
the existing parameters (`param.copy_`, what `reload_weights(is_checkpoint_format=False)` does)
keeps the storage CUDA graphs captured. On CPU the engine keeps the layers on these parameters
(vllm_adapt.plain_cpu_linears), so the same path runs and is tested there.
"""

from __future__ import annotations

import torch

from rlframe.resharding.formats import _FUSED

# "mlp.gate_proj" -> ("mlp.gate_up_proj", 0, 2): fused module, position, number of parts.
_PART_OF = {part: (fused, i, len(parts)) for fused, parts in _FUSED.items() for i, part in enumerate(parts)}


class KernelFormatFuser:
    """Buffer the parts of fused modules until all arrived; emit vLLM (name, tensor) pairs.

    `add(hf_name, local_shard)` returns the kernel-format tensors completed by that shard: the
    shard itself (renamed nothing) for unfused parameters, the concatenation for fused ones.
    """

    def __init__(self):
        self._pending: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, name: str, shard: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        for part, (fused, pos, count) in _PART_OF.items():
            tag = f".{part}."
            if tag not in name:
                continue
            key = name.replace(tag, f".{fused}.")
            parts = self._pending.setdefault(key, {})
            parts[pos] = shard
            if len(parts) < count:
                return []
            del self._pending[key]
            return [(key, torch.cat([parts[i] for i in range(count)], dim=0))]
        return [(name, shard)]

    def check_complete(self) -> None:
        if self._pending:
            raise ValueError(f"fused vLLM parameters missing parts at the end of the update: {sorted(self._pending)[:5]}")


def copy_into_kernel_params(model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copy kernel-format tensors into the model's parameters in place (leading rows when padded)."""
    from vllm.model_executor.model_loader.reload.inplace import get_parameter_for_reload

    for name, t in tensors:
        param = get_parameter_for_reload(model, name)
        if param.shape == t.shape:
            param.data.copy_(t)
        elif param.dim() == t.dim() and param.shape[1:] == t.shape[1:] and param.shape[0] >= t.shape[0]:
            param.data[: t.shape[0]].copy_(t)  # vocab padded to a multiple of 64 per rank
        else:
            raise ValueError(f"{name}: kernel parameter {tuple(param.shape)} cannot take a {tuple(t.shape)} shard")
