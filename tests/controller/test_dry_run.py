"""Dry runs of cluster configs on a laptop: no GPUs, no weights, no Ray."""

import pytest

from rlframe.config import load_config, validate
from rlframe.controller.dry_run import describe_run


@pytest.mark.parametrize("name", ["ppo_llama70b", "grpo_qwen7b", "ppo_tiny", "grpo_tiny"])
def test_cluster_configs_pass_the_dry_run(name):
    cfg = validate(load_config(name, ["trainer.dry_run=true"]))
    text = describe_run(cfg)
    assert "placement:" in text and "resharding" in text and "memory estimate per device" in text


def test_llama70b_plan_is_hybridflow_and_smaller_than_gather():
    cfg = validate(load_config("ppo_llama70b", ["trainer.dry_run=true"]))
    text = describe_run(cfg)
    assert "70.554B parameters" in text
    assert "HybridFlow (micro-DP groups)" in text
    line = next(l for l in text.splitlines() if l.startswith("resharding"))
    received = float(line.split("GiB, mean ")[1].split(" GiB")[0])  # stages differ slightly; the mean is exact
    full = float(line.split("would receive ")[1].split(" GiB")[0])
    # training tp=8, pp=4 -> gen tp=8: d_g = 4 and each rank receives (d_g - 1) / (t * p) of the model
    assert received == pytest.approx(full * 3 / 32, rel=0.01)
    assert "fits in 80 GiB" in text


def test_memory_estimate_uses_the_runtime_dtype_and_kv_cache():
    gpu = describe_run(validate(load_config("ppo_llama70b", ["trainer.dry_run=true"])))
    # bf16 weights (the rollout computes in the training dtype): 70.554B * 2 bytes / tp 8
    assert "rollout weights" in gpu and "16.43" in next(l for l in gpu.splitlines() if "rollout weights" in l)
    kv = next(l for l in gpu.splitlines() if "vLLM KV cache" in l)
    assert "gpu_memory_utilization budget - weights" in kv and float(kv.split()[-1]) == pytest.approx(28 - 16.43, abs=0.01)
    too_small = describe_run(validate(load_config("ppo_llama70b", ["trainer.dry_run=true",
                                                                    "rollout.gpu_memory_utilization=0.2"])))
    assert "vLLM gets no KV cache" in too_small and "does NOT fit" in too_small
    cpu = describe_run(validate(load_config("ppo_tiny", ["trainer.dry_run=true"])))
    assert "vLLM KV cache (rollout.kv_cache_bytes; on CPU at most)" in cpu and "0.25" in cpu  # CPU default 256 MiB


def test_dry_run_and_actor_pick_the_same_generation_layout():
    from rlframe.controller.dry_run import layouts
    from rlframe.resharding.layout import generation_layout

    cfg = validate(load_config("ppo_tiny", ["trainer.dry_run=true", "actor.strategy=megatron", "actor.dp=1",
                                            "actor.tp=2", "critic.strategy=megatron", "critic.dp=1", "critic.tp=2"]))
    train, gen, scheme = layouts(cfg)
    assert scheme.startswith("HybridFlow") and (gen, scheme) == generation_layout(train, tp=cfg.rollout.tp)
