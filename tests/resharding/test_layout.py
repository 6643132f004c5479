"""Layouts: rank order, validation messages, and the Box each rank holds (checked against torch.chunk)."""

import pytest
import torch

from rlframe.resharding.box import Box
from rlframe.resharding.formats import ModelDims, hf_param_shapes
from rlframe.resharding.layout import (
    Layout,
    hf_tp_split_dim,
    hybridflow_generation_layout,
    param_stage,
    stage_layer_range,
    training_box,
)

DIMS = ModelDims(num_layers=4, hidden_size=16, num_heads=4, num_kv_heads=2, intermediate_size=24,
                 vocab_size=30, qkv_bias=True)
# HybridFlow's nesting needs every split dim divisible by the larger tp (Megatron pads the vocabulary).
EVEN = ModelDims(num_layers=4, hidden_size=16, num_heads=4, num_kv_heads=2, intermediate_size=24,
                 vocab_size=32, qkv_bias=True)


def test_megatron_order_is_tp_fastest_then_dp_then_pp():
    lay = Layout(tp=2, dp=3, pp=2)
    for rank in range(lay.size):
        pp, tp, dp = lay.coords_of(rank)
        assert rank == tp + 2 * (dp + 3 * pp)
        assert lay.rank_of(pp=pp, tp=tp, dp=dp) == rank


def test_other_order_and_rank_subset():
    lay = Layout(tp=2, dp=2, order="dp-tp-pp", ranks=(4, 5, 6, 7))
    assert [lay.coords_of(r) for r in (4, 5, 6, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert lay.coords_of(0) is None and lay.box("lm_head.weight", (8, 4), 0) is None


def test_world_size_error_shows_arithmetic():
    with pytest.raises(ValueError, match=r"pp\(2\) \* tp\(2\) \* dp\(1\) = 4 != world size 8"):
        Layout(tp=2, pp=2).check_world_size(8)
    with pytest.raises(ValueError, match="order"):
        Layout(order="tp-pp")
    with pytest.raises(ValueError, match="exactly once"):
        Layout(tp=2, coords=((0, 0, 0), (0, 0, 0)))
    with pytest.raises(ValueError, match="distinct"):
        Layout(tp=2, ranks=(1, 1))


@pytest.mark.parametrize("name,dim", [
    ("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.0.self_attn.k_proj.bias", 0),
    ("model.layers.3.mlp.up_proj.weight", 0), ("model.layers.0.mlp.gate_proj.weight", 0),
    ("model.layers.0.self_attn.o_proj.weight", 1), ("model.layers.0.mlp.down_proj.weight", 1),
    ("model.layers.0.self_attn.o_proj.bias", None), ("model.embed_tokens.weight", 0), ("lm_head.weight", 0),
    ("model.norm.weight", None), ("model.layers.1.input_layernorm.weight", None),
])
def test_tp_split_rule(name, dim):
    assert hf_tp_split_dim(name) == dim


def test_boxes_match_torch_chunk_for_tp_and_fsdp():
    """Each rank's box indexes exactly torch.chunk(torch.chunk(full, tp, split)[t], dp, 0)[d]."""
    lay = Layout(tp=2, dp=3, fsdp=True)
    for name, shape in hf_param_shapes(DIMS).items():
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        split = hf_tp_split_dim(name)
        for rank in range(lay.size):
            _, t, d = lay.coords_of(rank)
            tp_shard = full if split is None else torch.chunk(full, 2, split)[t]
            chunks = torch.chunk(tp_shard, 3, 0)
            ref = chunks[d] if d < len(chunks) else None
            box = training_box(name, shape, lay, rank)
            if ref is None or ref.numel() == 0:
                assert box is None
            else:
                assert torch.equal(full[box.slices()], ref), (name, rank, box)


def test_pipeline_stages_are_contiguous_and_cover_all_layers():
    for n, pp in [(4, 2), (5, 2), (7, 3), (2, 2)]:
        ranges = [stage_layer_range(n, pp=pp, stage=s) for s in range(pp)]
        assert [i for r in ranges for i in r] == list(range(n))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    assert param_stage("model.embed_tokens.weight", num_layers=4, pp=2) == 0
    assert param_stage("model.norm.weight", num_layers=4, pp=2) == 1
    assert param_stage("lm_head.weight", num_layers=4, pp=2) == 1
    assert param_stage("model.layers.1.mlp.up_proj.weight", num_layers=4, pp=2) == 0
    assert param_stage("model.layers.2.mlp.up_proj.weight", num_layers=4, pp=2) == 1
    lay = Layout(pp=2)
    assert lay.box("lm_head.weight", (30, 16), 0, num_layers=4) is None
    assert lay.box("lm_head.weight", (30, 16), 1, num_layers=4) == Box.full((30, 16))
    with pytest.raises(ValueError, match="num_layers"):
        lay.box("lm_head.weight", (30, 16), 1)
    with pytest.raises(ValueError, match="at least one decoder layer"):
        stage_layer_range(1, pp=2, stage=0)


@pytest.mark.parametrize("t,p,d,tg,pg", [(4, 1, 1, 2, 1), (4, 1, 2, 1, 1), (2, 2, 1, 2, 1), (2, 2, 2, 1, 1),
                                         (4, 2, 1, 2, 2), (2, 1, 1, 2, 1)])
@pytest.mark.parametrize("fsdp", [False, True])
def test_hybridflow_training_shard_inside_generation_shard(t, p, d, tg, pg, fsdp):
    train = Layout(tp=t, pp=p, dp=d, fsdp=fsdp)
    gen = hybridflow_generation_layout(train, tp=tg, pp=pg)
    d_g = p * t // (pg * tg)
    assert gen.dp == d * d_g and gen.size == train.size
    for name, shape in hf_param_shapes(EVEN).items():
        for r in train.ranks:
            held = train.box(name, shape, r, num_layers=4)
            if held is not None:
                assert gen.box(name, shape, r, num_layers=4).contains(held), (name, r)


def test_hybridflow_micro_dp_groups_are_consecutive_ranks():
    gen = hybridflow_generation_layout(Layout(tp=4, dp=2), tp=2)
    # training tp ranks (0,1) complete generation tp shard 0, (2,3) shard 1: micro-DP = consecutive ranks
    assert [gen.coords_of(r)[1] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [gen.coords_of(r)[2] for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    with pytest.raises(ValueError, match="nest"):
        hybridflow_generation_layout(Layout(tp=2), tp=4)



@pytest.mark.parametrize("t,p,d,tg,scheme", [
    (2, 1, 1, 1, "HybridFlow"), (1, 2, 1, 1, "HybridFlow"), (2, 2, 2, 2, "HybridFlow"), (8, 4, 4, 8, "HybridFlow"),
    (4, 1, 1, 2, "general"),  # HybridFlow's tp groups would be strided ({0, 2}, {1, 3}); vLLM's are consecutive
])
def test_generation_layout_is_hybridflow_when_vllm_builds_its_tp_groups(t, p, d, tg, scheme):
    from rlframe.resharding.layout import generation_layout

    train = Layout(tp=t, pp=p, dp=d)
    gen, name = generation_layout(train, tp=tg)
    assert name.startswith(scheme)
    assert gen.ranks == train.ranks and gen.tp == tg and gen.dp == train.size // tg
    for i, rank in enumerate(gen.ranks):  # vLLM: tp rank = position in a block of tg consecutive ranks
        assert gen.coords_of(rank)[1] == i % tg
    if scheme == "HybridFlow":
        assert gen == hybridflow_generation_layout(train, tp=tg)


def test_generation_layout_of_fsdp_is_the_plain_one():
    from rlframe.resharding.layout import generation_layout

    gen, name = generation_layout(Layout(tp=2, dp=2, fsdp=True), tp=2)
    assert name.startswith("general") and gen == Layout(tp=2, dp=2)
