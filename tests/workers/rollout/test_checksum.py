"""Reading HF slices back out of vLLM's kernel layout (rollout/checksum.py), in pure torch: the
un-fusing is the inverse of kernel_format's fusing for every tp rank (padded vocabulary, replicated
kv heads), and both sides' digests agree on the same slice."""

from __future__ import annotations

import pytest
import torch

from rlframe.resharding.box import Box
from rlframe.resharding.formats import ModelDims, hf_param_shapes
from rlframe.workers.rollout.checksum import (
    UNVERIFIABLE, hf_slice_of_kernel_param, kernel_name, slice_digests, slice_key, tensor_digest, unfuse,
)
from rlframe.workers.rollout.kernel_format import KernelFormatFuser
from rlframe.workers.rollout.weight_sync import VOCAB_PADDING, vllm_needed_boxes

DIMS = ModelDims(num_layers=2, hidden_size=16, num_heads=4, num_kv_heads=2, intermediate_size=32,
                 vocab_size=100, qkv_bias=True)  # vocab 100: padded to 128, rank 1 of tp2 holds 36 real rows


def kernel_params(full: dict[str, torch.Tensor], needed: dict[str, Box], tp: int) -> dict[str, torch.Tensor]:
    """What a vLLM tp rank holds after a sync: kernel_format's fused tensors, copied into parameters
    whose vocabulary rows are padded (the padding rows NaN, as never written)."""
    fuser, out = KernelFormatFuser(), {}
    for name, t in full.items():
        for key, shard in fuser.add(name, t[needed[name].slices()]):
            if key.split(".")[-2] in ("embed_tokens", "lm_head"):
                rows = -(-DIMS.vocab_size // VOCAB_PADDING) * VOCAB_PADDING // tp
                param = torch.full((rows,) + tuple(shard.shape[1:]), float("nan"))
                param[: shard.shape[0]] = shard
                shard = param
            out[key] = shard
    fuser.check_complete()
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])  # tp4 > num_kv_heads=2: k/v heads replicated
def test_unfuse_is_the_inverse_of_kernel_format_fusing(tp):
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in hf_param_shapes(DIMS).items()}
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    for rank in range(tp):
        needed = vllm_needed_boxes(shapes, tp_rank=rank, tp_size=tp, num_kv_heads=DIMS.num_kv_heads,
                                   head_dim=DIMS.head_dim)
        params = kernel_params(full, needed, tp)
        for name, box in needed.items():
            read = hf_slice_of_kernel_param(name, needed, params[kernel_name(name)])
            assert isinstance(read, torch.Tensor), read
            assert torch.equal(read, full[name][box.slices()]), (rank, name)
        rollout = slice_digests({n: (b, hf_slice_of_kernel_param(n, needed, params[kernel_name(n)]))
                                 for n, b in needed.items()})
        assert all(d.verifiable for d in rollout)
        for d in rollout:  # the trainer's digest of the same slice of the full tensor
            assert d.digest == tensor_digest(full[d.name][d.box.slices()]), d.key


def test_unfuse_splits_by_part_rows_and_refuses_sizes_that_do_not_add_up():
    q, k, v = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    parts = unfuse(torch.cat([q, k, v]), [8, 2, 2])
    assert all(torch.equal(a, b) for a, b in zip(parts, (q, k, v)))
    with pytest.raises(ValueError, match="do not add up"):
        unfuse(torch.cat([q, k, v]), [8, 2, 3])


def test_a_kernel_tensor_of_another_shape_is_unverifiable_not_guessed():
    name = "model.layers.0.self_attn.k_proj.weight"
    shapes = hf_param_shapes(DIMS)
    needed = vllm_needed_boxes(shapes, tp_rank=0, tp_size=1, num_kv_heads=2, head_dim=DIMS.head_dim)
    repacked = torch.randn(16 + 8 + 8, 8, 2)  # e.g. a layer whose weight a kernel re-blocked
    why = hf_slice_of_kernel_param(name, needed, repacked)
    assert isinstance(why, str) and "qkv_proj" in why and "repacked" in why
    norm = "model.layers.0.input_layernorm.weight"
    assert isinstance(hf_slice_of_kernel_param(norm, needed, torch.randn(17)), str)
    (d,) = slice_digests({norm: (needed[norm], "why not")})
    assert not d.verifiable and d.digest == UNVERIFIABLE + "why not" and d.dtype == ""


def test_requested_boxes_inside_the_held_slice_only():
    t = torch.arange(24.0).reshape(6, 4)
    held = Box((2, 0), (4, 4))  # rows 2..5 of a (8, 4) parameter
    inner, outside = Box((3, 1), (2, 2)), Box((0, 0), (2, 4))
    inside, out = slice_digests({"w": (held, t[:4])}, {"w": inner, "x": inner}), slice_digests(
        {"w": (held, t[:4])}, {"w": outside})
    assert inside[0].digest == tensor_digest(t[1:3, 1:3]) and inside[0].key == "w[3:5,1:3]"
    assert not inside[1].verifiable and "no such parameter" in inside[1].digest
    assert not out[0].verifiable and "w[2:6,0:4]" in out[0].digest


def test_bf16_digest_is_of_the_cast_a_sync_makes():
    """A sync copies fp32 master weights into bf16 rollout parameters (`param.copy_`): the trainer's
    `.to(bf16)` rounds the same way, and a change below bf16's resolution is invisible in both."""
    master = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    param = torch.empty(64, 32, dtype=torch.bfloat16)
    param.copy_(master)
    assert tensor_digest(param) == tensor_digest(master.to(torch.bfloat16))
    assert tensor_digest(param) != tensor_digest(master)
    nudged = master.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(10.0))
    assert tensor_digest(nudged.to(torch.bfloat16)) == tensor_digest(param)
    assert slice_key("w", Box((0, 0), (64, 32))) == "w[0:64,0:32]"
