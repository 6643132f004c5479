"""HF checkpoints in and out of a megatron-core model, one (tp rank, pp stage) at a time.

Loading reads only this rank's slices from the safetensors files (`get_slice`), so a 70B model is
never materialised whole on one rank: the Box each rank needs comes from the resharding layout
(`Layout.box`: Megatron's tp split, pipeline stage ownership), and `hf_to_megatron` packs the slices
into megatron-core's fused tensors. Going out, `megatron_to_hf` unpacks the local parameters into
HF-named shards with the same boxes, which is what the resharding planner moves into vLLM.
"""

from __future__ import annotations

import torch

from rlframe.resharding.box import Box
from rlframe.resharding.formats import ModelDims, hf_param_shapes, hf_to_megatron, megatron_to_hf
from rlframe.resharding.layout import Layout
from rlframe.workers.engines.hf_weights import iter_slices
from rlframe.workers.engines.value_head import VALUE_HEAD, fresh_value_head

def hf_shapes(dims: ModelDims, *, head: str) -> dict[str, tuple[int, ...]]:
    """HF parameter names -> global shapes of the model with this head (critic: `score` for lm_head)."""
    shapes = hf_param_shapes(dims)
    if head == "value":
        del shapes["lm_head.weight"]
        shapes.update({"score.weight": (1, dims.hidden_size), "score.bias": (1,)})
    return shapes


def hf_param_metas(dims: ModelDims, *, head: str, dtype: torch.dtype) -> dict:
    """HF name -> ParamMeta of every parameter (the resharding planner's input, the same on all ranks)."""
    from rlframe.resharding.planner import ParamMeta

    return {n: ParamMeta(tuple(s), dtype) for n, s in hf_shapes(dims, head=head).items()}


def rank_boxes(dims: ModelDims, *, head: str, layout: Layout, rank: int) -> dict[str, tuple[tuple[int, ...], Box]]:
    """{HF name: (global shape, Box)} of what `rank` holds in `layout` (dp replicas hold the same)."""
    out = {}
    for name, shape in hf_shapes(dims, head=head).items():
        box = layout.box(name, shape, rank, num_layers=dims.num_layers)
        if box is not None:
            out[name] = (shape, box)
    return out


def read_hf_slices(model_path: str, boxes: dict[str, tuple[tuple[int, ...], Box]]) -> dict[str, torch.Tensor]:
    """The boxes of the named tensors the checkpoint has (hf_weights.iter_slices)."""
    return dict(iter_slices(model_path, boxes))


def _model_params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def load_megatron_state(model, state: dict[str, torch.Tensor]) -> None:
    """Copy megatron-named tensors into `model`'s parameters; every parameter exactly once."""
    params = _model_params(model)
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"HF -> Megatron conversion does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            t = state[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{name}: converted shape {tuple(t.shape)} != the model's {tuple(p.shape)}")
            p.copy_(t)


def load_hf_weights(model, *, model_path: str, dims: ModelDims, head: str, layout: Layout, rank: int,
                    seed: int) -> list[str]:
    """Load this rank's part of the HF checkpoint into `model`; returns the HF names initialised
    from `seed` instead (the critic's `score` when the checkpoint is a causal LM)."""
    pp_rank = layout.coords_of(rank)[0]
    boxes = rank_boxes(dims, head=head, layout=layout, rank=rank)
    hf = read_hf_slices(model_path, boxes)
    fresh = [n for n in boxes if n not in hf]
    if any(n not in VALUE_HEAD for n in fresh):
        raise ValueError(f"{model_path!r} lacks parameters {[n for n in fresh if n not in VALUE_HEAD][:5]}")
    if fresh:  # identical on every rank (the head is replicated over tp and dp) and to the fsdp engine's
        head_init = fresh_value_head(dims.hidden_size, seed=seed)
        for n in fresh:
            hf[n] = head_init[n]
    state = hf_to_megatron(hf, dims=dims, tp=layout.tp, pp=layout.pp, pp_rank=pp_rank, spec="local", head=head)
    load_megatron_state(model, state)
    return fresh


def hf_shards(model, *, dims: ModelDims, head: str, layout: Layout, rank: int) -> dict[str, tuple]:
    """HF name -> (global shape, Box, tensor) of this rank's parameters (the engine's `local_shards`).

    Fused tensors (qkv, fc1) are unpacked: q/k/v come out as copies, the rest as views.
    """
    pp_rank = layout.coords_of(rank)[0]
    meg = {n: p.detach() for n, p in _model_params(model).items()}
    hf = megatron_to_hf(meg, dims=dims, tp=layout.tp, pp=layout.pp, pp_rank=pp_rank, head=head)
    boxes = rank_boxes(dims, head=head, layout=layout, rank=rank)
    if hf.keys() != boxes.keys():
        raise AssertionError(f"rank {rank}: model shards {sorted(set(hf) ^ set(boxes))[:5]} differ from the layout")
    out = {}
    for name, t in hf.items():
        shape, box = boxes[name]
        assert tuple(t.shape) == box.sizes, (name, tuple(t.shape), box)
        out[name] = (shape, box, t.contiguous())
    return out
