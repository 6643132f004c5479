"""transformers rollout engine serving a LoRA adapter (forward hooks, base weights untouched)
against the same model with the adapter merged into its weights; adapter shapes and TP boxes."""

from __future__ import annotations

import pytest
import torch

from rlframe.data.tiny_model import build_random_model
from rlframe.resharding.box import Box
from rlframe.workers.rollout import RolloutConfig, SamplingConfig, logprob_diff_metrics, response_log_probs
from rlframe.workers.rollout.hf_engine import HFRolloutEngine
from rlframe.workers.rollout.lora import adapter_spec, lora_param_shapes, merge_adapter
from rlframe.workers.rollout.lora import lora_needed_boxes
from tests.workers.rollout.common import merged_weights, perturbed, piece_buckets, prompt_batch, random_adapter

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = str(build_random_model(tmp_path_factory.mktemp("model"), preset="test", seed=0))
    engine = HFRolloutEngine(path, config=RolloutConfig(backend="hf", lora_rank=8, lora_alpha=16,
                                                       lora_target_modules=("q_proj", "v_proj", "down_proj")))
    reference = HFRolloutEngine(path, config=RolloutConfig(backend="hf"))
    base = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    engine.path = path
    return engine, reference, base


def test_adapter_versions_match_merged_weights_and_leave_base_untouched(engines):
    engine, reference, base = engines
    prompts = prompt_batch(engine.tokenizer, 8)
    before = engine.generate(prompts, GREEDY).batch["responses"]
    previous = before
    for seed, config, scaling in ((1, {"r": 8, "lora_alpha": 16}, 2.0), (2, {"rank": 4, "alpha": 2.0}, 0.5)):
        adapter = random_adapter(engine.lora_shapes(config), seed=seed, scale=0.2)
        with engine.lora_update(config) as consume:
            for bucket in piece_buckets(adapter, engine.lora_needed_boxes(config)):
                consume(bucket)
        reference.update_weights(merged_weights(base, adapter, scaling))
        out = engine.generate(prompts, GREEDY).batch
        assert torch.equal(out["responses"], reference.generate(prompts, GREEDY).batch["responses"])
        m = logprob_diff_metrics(out["rollout_log_probs"], response_log_probs(reference.model, out),
                                 out["response_mask"])
        assert m["rollout/logprob_diff_max"] < 1e-4, m
        assert not torch.equal(out["responses"], previous)  # the new version is served, not the old one
        previous = out["responses"]
    assert engine.lora_version == 2 and len(engine._lora_hooks) == 3 * 2  # one hook per adapted projection
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, base[n]), n


def test_base_weight_update_keeps_the_adapter(engines):
    engine, reference, base = engines
    config = {"r": 8, "lora_alpha": 16}
    adapter = random_adapter(engine.lora_shapes(config), seed=3, scale=0.2)
    engine.update_lora(adapter, config)
    new_base = perturbed(base, seed=4)
    try:
        engine.update_weights(new_base)
        reference.update_weights(merged_weights(new_base, adapter, 2.0))
        prompts = prompt_batch(engine.tokenizer, 8)
        assert torch.equal(engine.generate(prompts, GREEDY).batch["responses"],
                           reference.generate(prompts, GREEDY).batch["responses"])
    finally:
        engine.update_weights(base)


def test_lora_errors(engines):
    engine, reference, _ = engines
    config = {"r": 8, "lora_alpha": 16}
    adapter = random_adapter(engine.lora_shapes(config), seed=5)
    with pytest.raises(ValueError, match="not fully received"):
        engine.update_lora(dict(list(adapter.items())[:3]), config)
    with pytest.raises(ValueError, match="rollout.lora_rank=8"):
        engine.lora_shapes({"r": 16, "lora_alpha": 16})
    with pytest.raises(ValueError, match="lora_rank=0"):
        reference.lora_shapes(config)  # built without LoRA: merge and use weight_update instead
    shared = HFRolloutEngine(engine.path, config=RolloutConfig(backend="hf", lora_rank=8), model=reference.model)
    with pytest.raises(ValueError, match="shares the trainer's module"):
        shared.lora_shapes(config)
    with pytest.raises(ValueError, match="rank_pattern"):
        adapter_spec({"r": 8, "rank_pattern": {"q_proj": 4}}, default_rank=8, default_alpha=16,
                     default_targets=("q_proj",))
    with pytest.raises(ValueError, match="lora_rank"):
        RolloutConfig(lora_rank=-1)


def test_lora_shapes_and_tp_boxes():
    base = {"model.layers.0.self_attn.q_proj.weight": (128, 128), "model.layers.0.self_attn.k_proj.weight": (64, 128),
            "model.layers.0.self_attn.o_proj.weight": (128, 128), "model.layers.0.mlp.up_proj.weight": (384, 128),
            "model.layers.0.input_layernorm.weight": (128,), "model.layers.0.self_attn.q_proj.bias": (128,)}
    targets = ("q_proj", "k_proj", "o_proj", "up_proj")
    shapes = lora_param_shapes(base, rank=4, target_modules=targets)
    assert shapes["model.layers.0.self_attn.q_proj.lora_A.weight"] == (4, 128)
    assert shapes["model.layers.0.mlp.up_proj.lora_B.weight"] == (384, 4)
    assert len(shapes) == 8
    # tp 4 with 2 kv heads of 32: vLLM replicates each kv head on two ranks; B of k follows
    boxes = [lora_needed_boxes(shapes, tp_rank=r, tp_size=4, num_kv_heads=2, head_dim=32) for r in range(4)]
    k_b = "model.layers.0.self_attn.k_proj.lora_B.weight"
    assert [b[k_b] for b in boxes] == [Box((0, 0), (32, 4))] * 2 + [Box((32, 0), (32, 4))] * 2
    assert boxes[3]["model.layers.0.self_attn.q_proj.lora_B.weight"] == Box((96, 0), (32, 4))
    assert boxes[1]["model.layers.0.self_attn.o_proj.lora_A.weight"] == Box((0, 32), (4, 32))
    assert boxes[1]["model.layers.0.self_attn.o_proj.lora_B.weight"] == Box.full((128, 4))
    assert boxes[2]["model.layers.0.self_attn.q_proj.lora_A.weight"] == Box.full((4, 128))


def test_merge_fallback_gives_the_adapted_model(engines):
    engine, reference, base = engines
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    adapter = random_adapter(engine.lora_shapes(config), seed=6, scale=0.2)
    engine.update_lora(adapter, config)
    try:
        reference.update_weights(merge_adapter(base, adapter, scaling=2.0))  # what a lora_rank=0 engine gets
        prompts = prompt_batch(engine.tokenizer, 8)
        assert torch.equal(engine.generate(prompts, GREEDY).batch["responses"],
                           reference.generate(prompts, GREEDY).batch["responses"])
    finally:
        reference.update_weights(base)
