"""Build the (dp, tp) or (dp, sp, tp) device mesh, check a model fits it, and apply TP then FSDP2.

Order (as in torchtitan): tensor parallelism first (`parallelize_module` on the "tp" mesh), then
activation checkpointing when asked for, then FSDP2 (`fully_shard` on the "dp" mesh) per decoder layer and on the root. Parameters end up as
DTensors on the 2-D mesh: dim 0 sharded over dp on top of the Megatron split over tp.

Tensor-parallel plan (Megatron-LM, Shoeybi et al. 2019, section 3):
- q/k/v and gate/up projections are column-parallel (output features split; heads stay whole);
- o and down projections are row-parallel (input features split, outputs all-reduced);
- the token embedding is vocab-parallel (rows split, masked lookup, all-reduce);
- the LM head is vocab-parallel: each tp rank computes logits for its vocab slice and the
  log-softmax is done across slices (`vocab_parallel.py`), never gathering (N, V) logits;
- norms and the critic's score head are replicated over tp (sharded over dp by FSDP);
- a projection with a LoRA adapter (engines/lora.py, injected before this) gets the matching
  LoRA style instead: column-parallel ones split lora_B on its output dim and replicate lora_A,
  row-parallel ones split lora_A on its input dim and replicate lora_B.
No Megatron sequence parallelism: activations are replicated over tp, so sequence lengths need not
divide anything. What must divide by tp (checked before any work): attention heads, key/value heads,
intermediate size and vocabulary size.

Ulysses sequence parallelism (sp > 1, ulysses.py) adds an "sp" dim between dp and tp: the sp ranks of
a dp replica split each micro-batch's positions, and hold the weights as dp ranks do: FSDP2 shards
them over the flattened (dp, sp) ranks. Each tp rank's attention heads must split over sp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def mesh_dims(sp: int) -> tuple[str, ...]:
    """The engine mesh's dims, outermost first: ("dp", "tp"), with "sp" between them when sp > 1."""
    return ("dp", "sp", "tp") if sp > 1 else ("dp", "tp")


def build_mesh(*, dp: int, tp: int, device_type: str, sp: int = 1) -> DeviceMesh:
    """The engine's mesh over all ranks of the default group; tp is the fastest-varying dim."""
    world = dist.get_world_size()
    sizes = {"dp": dp, "sp": sp, "tp": tp}
    dims = mesh_dims(sp)
    if dp * sp * tp != world:
        arithmetic = " * ".join(f"{d}({sizes[d]})" for d in dims)
        raise ValueError(
            f"layout {arithmetic} = {dp * sp * tp} != WORLD_SIZE({world}); "
            f"choose {'/'.join(dims)} whose product is the number of ranks of the worker group"
        )
    return init_device_mesh(device_type, tuple(sizes[d] for d in dims), mesh_dim_names=dims)


def check_mesh(mesh: DeviceMesh, *, dp: int, tp: int, sp: int = 1) -> None:
    dims, sizes = mesh_dims(sp), {"dp": dp, "sp": sp, "tp": tp}
    if tuple(mesh.mesh_dim_names or ()) != dims:
        raise ValueError(f"the engine needs a mesh with dims {dims}, got {mesh.mesh_dim_names}")
    if tuple(mesh.shape) != tuple(sizes[d] for d in dims):
        raise ValueError(f"mesh shape {tuple(mesh.shape)} does not match config dp={dp}, sp={sp}, tp={tp}")


def fsdp_mesh(mesh: DeviceMesh, *, sp: int) -> DeviceMesh:
    """The ranks FSDP2 shards the weights over: dp, or the flattened (dp, sp) under Ulysses."""
    return mesh["dp", "sp"]._flatten("dp_sp") if sp > 1 else mesh["dp"]


def check_model_fits(hf_config, *, tp: int, model_type_path: str, sp: int = 1) -> None:
    """Fail early, with the arithmetic, when the model's dims do not split over tp (and its heads
    over tp x sp)."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if getattr(hf_config, "tie_word_embeddings", False) and tp > 1:
        raise ValueError(
            f"{model_type_path}: tie_word_embeddings=True with tp={tp} is not supported (the tied "
            "weight would need two tensor-parallel layouts); use an untied model or tp=1"
        )
    dims = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": hf_config.intermediate_size,
        "vocab_size": hf_config.vocab_size,
    }
    bad = {k: v for k, v in dims.items() if v % tp}
    if bad:
        text = ", ".join(f"{k}={v} % tp({tp}) = {v % tp}" for k, v in bad.items())
        raise ValueError(
            f"{model_type_path} does not split over tp={tp}: {text}; choose a tp that divides "
            "the attention heads, key/value heads, intermediate size and vocabulary size"
        )
    if sp > 1 and heads % (tp * sp):
        raise ValueError(
            f"{model_type_path}: Ulysses sequence parallelism gives each of the tp({tp}) x sp({sp}) ranks "
            f"of a replica whole attention heads, but num_attention_heads={heads} % {tp * sp} = {heads % (tp * sp)}; "
            "choose sp (and tp) so that tp * sp divides the attention heads"
        )


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a Llama-style HF model (`model.model.layers`), checked for the plan."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no `.model.layers`; the fsdp engine supports Llama-style "
            "decoder models (Llama, Qwen2, Mistral, ...)"
        )
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [n for n in _ATTN if not hasattr(attn, n)] + [n for n in _MLP if not hasattr(mlp, n)]
        if names:
            raise ValueError(
                f"{type(model).__name__} layer {i} lacks {names}; the tensor-parallel plan needs "
                "self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj"
            )
    return list(layers)


def apply_tensor_parallel(model, tp_mesh: DeviceMesh, *, head: str) -> None:
    """Megatron-style column/row/vocab-parallel plan over `tp_mesh` (see module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from rlframe.workers.engines.lora import LoraLinear, lora_parallel_style

    def style(path: str, kind: str):
        if isinstance(model.get_submodule(path), LoraLinear):
            return lora_parallel_style(kind)
        return ColwiseParallel() if kind == "colwise" else RowwiseParallel()

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    for i in range(len(decoder_layers(model))):
        p = f"model.layers.{i}"
        plan.update({f"{p}.self_attn.{n}": style(f"{p}.self_attn.{n}", "colwise") for n in ("q_proj", "k_proj", "v_proj")})
        plan[f"{p}.self_attn.o_proj"] = style(f"{p}.self_attn.o_proj", "rowwise")
        plan.update({f"{p}.mlp.{n}": style(f"{p}.mlp.{n}", "colwise") for n in ("gate_proj", "up_proj")})
        plan[f"{p}.mlp.down_proj"] = style(f"{p}.mlp.down_proj", "rowwise")
    if head == "lm":
        # Local logits (N, V / tp); the engine's log-softmax works on the slices.
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    parallelize_module(model, tp_mesh, plan)


def apply_activation_checkpointing(model) -> None:
    """Each decoder layer keeps only its input for the backward and recomputes the rest there
    (torch.utils.checkpoint, non-reentrant). Applied before FSDP2: the layer's FSDP hooks wrap the
    checkpointed forward, so its parameters are gathered when the backward recomputes it (FSDP's
    pre-backward all-gather runs first). The module tree, and so every parameter name, is unchanged;
    the recompute re-runs tensor-parallel collectives in the same order on every rank."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    for layer in decoder_layers(model):
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)


def apply_fsdp(model, dp_mesh: DeviceMesh, *, mixed_precision: bool, reshard_after_forward: bool = True) -> None:
    """FSDP2 per decoder layer, then the root (embedding, final norm, head); the root alone when
    reshard_after_forward=False.

    reshard_after_forward=False (the engine's gather-once mode, default on CPU) holds the whole
    model's gathered parameters through the step anyway, so the model is one FSDP group there: one
    all-gather and one reduce-scatter per step instead of one per layer (each a gloo round trip;
    the demo model's training step 0.205-0.214 -> 0.183-0.197 s per rank, dp2). Parameters are
    sharded the same way (dim 0 of each) either way, so checkpoints and weight sync do not change."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mixed_precision:
        # bf16 compute and all-gathers; fp32 gradient reduction and fp32 sharded master weights.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if reshard_after_forward:
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def reshard_all(model) -> None:
    """Free every FSDP module's gathered parameters (the root's `reshard()` frees only its own group;
    layers kept gathered by reshard_after_forward=False would stay full after a no-grad forward)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
