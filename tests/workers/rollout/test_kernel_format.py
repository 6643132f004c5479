"""GPU in-place path's fusing of HF shards into vLLM's per-rank tensors, against resharding.formats."""

from __future__ import annotations

import pytest
import torch

from rlframe.resharding.formats import ModelDims, hf_param_shapes, hf_to_vllm
from rlframe.workers.rollout.kernel_format import KernelFormatFuser


def test_fuser_matches_hf_to_vllm_for_one_rank_in_any_order():
    dims = ModelDims(num_layers=2, hidden_size=16, num_heads=4, num_kv_heads=2, intermediate_size=32,
                     vocab_size=40, qkv_bias=True)
    g = torch.Generator().manual_seed(0)
    shards = {n: torch.randn(s, generator=g) for n, s in hf_param_shapes(dims).items()}
    expected = hf_to_vllm(shards, dims=dims, tp=1)
    fuser, got = KernelFormatFuser(), {}
    for name in reversed(list(shards)):  # v before k before q: buffering must not depend on order
        for key, t in fuser.add(name, shards[name]):
            got[key] = t
    fuser.check_complete()
    assert set(got) == set(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_fuser_reports_missing_parts():
    fuser = KernelFormatFuser()
    assert fuser.add("model.layers.0.mlp.gate_proj.weight", torch.ones(2, 2)) == []
    with pytest.raises(ValueError, match="gate_up_proj"):
        fuser.check_complete()
