"""Format conversion: HF <-> Megatron-core <-> vLLM, per TP rank and PP stage, round trip and layout."""

import pytest
import torch

from rlframe.resharding.formats import (
    ModelDims,
    hf_param_shapes,
    hf_to_megatron,
    hf_to_vllm,
    megatron_to_hf,
    vllm_to_hf,
)
from rlframe.resharding.layout import Layout

QWEN2 = ModelDims(num_layers=4, hidden_size=32, num_heads=8, num_kv_heads=4, intermediate_size=48,
                  vocab_size=40, qkv_bias=True)
LLAMA = ModelDims(num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=4, intermediate_size=96,
                  vocab_size=32, head_dim=16)  # head_dim * heads != hidden: o_proj is not square


def full_model(dims: ModelDims) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in hf_param_shapes(dims).items()}


def boxes(full, dims, *, tp, pp, tp_rank, pp_rank):
    """{name: Box} this (tp rank, pp stage) holds, by the layout rule the planner uses."""
    lay = Layout(tp=tp, pp=pp)
    r = lay.rank_of(pp=pp_rank, tp=tp_rank)
    out = {n: lay.box(n, t.shape, r, num_layers=dims.num_layers) for n, t in full.items()}
    return {n: b for n, b in out.items() if b is not None}


def shards(full, dims, **kw):
    return {n: full[n][b.slices()].clone() for n, b in boxes(full, dims, **kw).items()}


def megatron_qkv_reference(qkv, dims, tp):
    """How megatron-core reads linear_qkv: view (groups, (r + 2) * hd, H), split [r*hd, hd, hd]."""
    groups, r, hd = dims.num_kv_heads // tp, dims.num_heads // dims.num_kv_heads, dims.head_dim
    x = qkv.view(groups, (r + 2) * hd, *qkv.shape[1:])
    q, k, v = torch.split(x, [r * hd, hd, hd], dim=1)
    return q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:])


@pytest.mark.parametrize("dims", [QWEN2, LLAMA], ids=["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("spec", ["local", "te"])
def test_megatron_round_trip_and_layout(dims, tp, pp, spec):
    full = full_model(dims)
    rebuilt = {n: torch.full_like(t, float("nan")) for n, t in full.items()}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            hf = shards(full, dims, tp=tp, pp=pp, tp_rank=tp_rank, pp_rank=pp_rank)
            meg = hf_to_megatron(hf, dims=dims, tp=tp, pp=pp, pp_rank=pp_rank, spec=spec)
            first = 0 if pp_rank == 0 else dims.num_layers // 2
            # layer numbers are stage-local; the fused tensors read back the way megatron-core reads them
            assert ("embedding.word_embeddings.weight" in meg) == (pp_rank == 0)
            assert ("output_layer.weight" in meg) == ("decoder.final_layernorm.weight" in meg) == (pp_rank == pp - 1)
            qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"]
            for got, proj in zip(megatron_qkv_reference(qkv, dims, tp), "qkv"):
                assert torch.equal(got, hf[f"model.layers.{first}.self_attn.{proj}_proj.weight"])
            if dims.qkv_bias:
                b = meg["decoder.layers.0.self_attention.linear_qkv.bias"]
                assert torch.equal(megatron_qkv_reference(b, dims, tp)[1], hf[f"model.layers.{first}.self_attn.k_proj.bias"])
            fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
            assert torch.equal(fc1, torch.cat([hf[f"model.layers.{first}.mlp.gate_proj.weight"],
                                               hf[f"model.layers.{first}.mlp.up_proj.weight"]]))
            norm = {"te": "self_attention.linear_qkv.layer_norm_weight", "local": "input_layernorm.weight"}[spec]
            assert torch.equal(meg[f"decoder.layers.0.{norm}"], hf[f"model.layers.{first}.input_layernorm.weight"])
            back = megatron_to_hf(meg, dims=dims, tp=tp, pp=pp, pp_rank=pp_rank)
            assert back.keys() == hf.keys()
            assert all(torch.equal(back[n], hf[n]) for n in hf)
            for n, b in boxes(full, dims, tp=tp, pp=pp, tp_rank=tp_rank, pp_rank=pp_rank).items():
                rebuilt[n][b.slices()] = back[n]
    # all ranks' shards converted there and back tile the original model exactly
    assert all(torch.equal(rebuilt[n], full[n]) for n in full)


@pytest.mark.parametrize("dims", [QWEN2, LLAMA], ids=["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vllm_round_trip_and_layout(dims, tp):
    full = full_model(dims)
    for tp_rank in range(tp):
        hf = shards(full, dims, tp=tp, pp=1, tp_rank=tp_rank, pp_rank=0)
        vl = hf_to_vllm(hf, dims=dims, tp=tp)
        p = "model.layers.1."
        assert torch.equal(vl[p + "self_attn.qkv_proj.weight"], torch.cat(
            [hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
        assert torch.equal(vl[p + "mlp.gate_up_proj.weight"], torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]))
        assert (p + "self_attn.qkv_proj.bias" in vl) == dims.qkv_bias
        assert p + "self_attn.q_proj.weight" not in vl and p + "self_attn.o_proj.weight" in vl
        back = vllm_to_hf(vl, dims=dims, tp=tp)
        assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)


def test_tp_that_splits_kv_heads_is_rejected():
    with pytest.raises(ValueError, match=r"num_kv_heads\(4\) % tp\(8\)"):
        hf_to_vllm({}, dims=QWEN2, tp=8)
    with pytest.raises(ValueError, match="unexpected HF parameter"):
        hf_to_megatron({"model.rotary.inv_freq": torch.zeros(1)}, dims=QWEN2, tp=1)


def test_dims_from_hf_config():
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4)
    assert ModelDims.from_hf_config(cfg) == QWEN2
