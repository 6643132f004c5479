"""LoRA adapters in the rollout engines: the adapter's settings, its parameter shapes, and which
slice of each factor a generation-TP rank needs.

The trainer sends only the adapter each step (adapter-only weight sync); the base weights stay
as loaded. Names are HF/PEFT names without PEFT's `base_model.model.` prefix:

    model.layers.{i}.self_attn.q_proj.lora_A.weight   (r, in)
    model.layers.{i}.self_attn.q_proj.lora_B.weight   (out, r)

and the adapted projection computes `x W^T + scaling * (x A^T) B^T` with scaling = alpha / r
(alpha / sqrt(r) with rsLoRA). Targets: q, k, v, o, gate, up and down projections of every
decoder layer.

Adapter config (`lora_update(config)`): a dict in PEFT's keys (`r`, `lora_alpha`, `target_modules`,
`use_rslora`) or the training engine's (`rank`, `alpha`, `target_modules`); missing keys default to
the RolloutConfig's lora_rank / lora_alpha / lora_target_modules.

Which boxes a vLLM TP rank needs (`lora_tp_box`): vLLM keeps the whole adapter on every rank and
slices it when it copies it into its stacked LoRA buffers (`set_lora` -> `slice_lora_a/b` in
vllm/lora/layers/column_parallel_linear.py and row_parallel_linear.py). Only the slice it keeps is
ever read, so a rank receives only that slice, exactly the base weight's split:
- column-parallel (q, k, v, gate, up): lora_B rows split like the base weight's output rows
  (k/v with the same kv-head replication when tp > num_kv_heads); lora_A replicated (full);
- row-parallel (o, down): lora_A columns split like the base weight's input columns; lora_B
  replicated (full).
(vLLM's `fully_sharded_loras=True` would also split A of column-parallel layers by rank; the
engine does not turn it on.)

Fallback where adapters cannot be served (a backend without LoRA support, or targets vLLM cannot
adapt): build the engine with lora_rank=0, merge on the trainer side (W + scaling * B @ A for every
target; `merge_adapter` does it one parameter at a time) and send the merged full weights through the
ordinary `weight_update()` / `update_weights()`. That costs a full-weight sync per step instead of an
adapter-sized one, and is exact up to the rounding of the merge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from rlframe.resharding.box import Box
# The projections adapters may target and how tensor parallelism splits them are the training
# engine's (a sync moves its shards into vLLM's slices of the same split); PEFT's name prefix too.
from rlframe.workers.engines.lora import COLUMN_PARALLEL, PEFT_PREFIX, ROW_PARALLEL, SUPPORTED_TARGETS
from rlframe.workers.rollout.weight_sync import vllm_tp_box

# vLLM's allowed `max_lora_rank` values (vllm.config.lora.MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter version's settings: rank, scaling and the projections it adapts."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA adapter rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA adapter alpha must be > 0, got {self.alpha}")
        unknown = sorted(set(self.target_modules) - set(SUPPORTED_TARGETS))
        if unknown or not self.target_modules:
            raise ValueError(f"LoRA target_modules {list(self.target_modules)}: the rollout engines adapt only "
                             f"{list(SUPPORTED_TARGETS)} (unsupported: {unknown}); for other modules merge the "
                             "adapter into the weights and sync them with weight_update() (see rollout/lora.py)")

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


def adapter_spec(config: Mapping | None, *, default_rank: int, default_alpha: float,
                 default_targets: tuple[str, ...]) -> AdapterSpec:
    """Read an adapter config dict (PEFT or training-engine keys); see the module docstring."""
    config = dict(config or {})
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"LoRA adapter config {key}={config[key]!r}: per-module ranks/alphas are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter config bias={config['bias']!r}: adapter biases are not supported")
    rank = int(config.get("r", config.get("rank", default_rank)))
    alpha = float(config.get("lora_alpha", config.get("alpha", default_alpha)))
    targets = config.get("target_modules", default_targets)
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return AdapterSpec(rank=rank, alpha=alpha, target_modules=targets,
                       use_rslora=bool(config.get("use_rslora", False)))


def lora_param_shapes(base_shapes: Mapping[str, tuple[int, ...]], *, rank: int,
                      target_modules: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """{adapter name: shape} for every targeted projection weight of `base_shapes` ({HF name: shape})."""
    shapes = {}
    for name, shape in base_shapes.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in target_modules or len(shape) != 2:
            continue
        out_f, in_f = (int(s) for s in shape)
        stem = name[: -len(".weight")]
        shapes[f"{stem}.lora_A.weight"] = (rank, in_f)
        shapes[f"{stem}.lora_B.weight"] = (out_f, rank)
    return shapes


def base_weight_name(lora_name: str) -> str:
    """`...q_proj.lora_B.weight` -> `...q_proj.weight`."""
    stem, factor, leaf = lora_name.rsplit(".", 2)
    if factor not in ("lora_A", "lora_B") or leaf != "weight":
        raise ValueError(f"{lora_name!r} is not a LoRA factor name (...<proj>.lora_A.weight / .lora_B.weight)")
    return f"{stem}.weight"


def lora_tp_box(name: str, shape, *, tp_rank: int, tp_size: int, num_kv_heads: int, head_dim: int) -> Box:
    """The Box of adapter factor `name` (global `shape`) that vLLM's TP rank `tp_rank` keeps."""
    shape = tuple(int(s) for s in shape)
    base = base_weight_name(name)
    module, factor = base.split(".")[-2], name.split(".")[-2]
    split = (factor == "lora_B" and module in COLUMN_PARALLEL) or (factor == "lora_A" and module in ROW_PARALLEL)
    if tp_size == 1 or not split:
        return Box.full(shape)
    # The factor's split dim is the base weight's (rows of B = output rows, columns of A = input columns).
    return vllm_tp_box(base, shape, tp_rank=tp_rank, tp_size=tp_size, num_kv_heads=num_kv_heads, head_dim=head_dim)


def lora_needed_boxes(lora_shapes: Mapping[str, tuple[int, ...]], *, tp_rank: int, tp_size: int,
                      num_kv_heads: int, head_dim: int) -> dict[str, Box]:
    """{adapter factor name: Box} a vLLM TP rank needs per adapter update (`lora_tp_box`): B of
    q/k/v/gate/up and A of o/down split like their base weight, the other factor in full."""
    return {n: lora_tp_box(n, s, tp_rank=tp_rank, tp_size=tp_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
            for n, s in lora_shapes.items()}


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"rollout.lora_rank={rank} exceeds vLLM's largest max_lora_rank {VLLM_MAX_LORA_RANKS[-1]}")


def merge_adapter(base: Mapping, adapter: Mapping, *, scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every base parameter, adapted projections as W + scaling * B @ A (the fallback
    above; feed it to `update_weights`). One merged tensor is alive at a time; `base` is not modified."""
    for name, weight in base.items():
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        a = adapter.get(f"{stem}.lora_A.weight") if stem is not None else None
        if a is None:
            yield name, weight
            continue
        b = adapter[f"{stem}.lora_B.weight"]
        yield name, weight + scaling * (b.to(weight.dtype) @ a.to(weight.dtype))
