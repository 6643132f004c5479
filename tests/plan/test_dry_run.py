"""Dry runs of cluster configs on a laptop: no GPUs, no weights, no Ray."""

import pytest

from rlframe.config import load_config, validate
from rlframe.plan.dry_run import describe_run
from rlframe.plan.memory_estimate import GiB


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
    assert "peak: stage 0 decides:" in text and "GiB of 79.19: fits" in text


def memory(name: str, *overrides: str) -> str:
    """The memory table alone (fast: no resharding plan)."""
    from rlframe.plan.dry_run import memory_lines, model_dims
    from rlframe.resharding.formats import hf_param_shapes

    cfg = validate(load_config(name, ["trainer.dry_run=true", *overrides]))
    dims = model_dims(cfg)
    return "\n".join(memory_lines(cfg, dims, hf_param_shapes(dims)))


def _row(text: str, starts: str) -> list[float]:
    """The numbers of the memory table's row whose name starts with `starts` (one per column)."""
    cells = next(l for l in text.splitlines() if l.strip().startswith(starts)).split()
    values = []
    while cells and cells[-1].replace(".", "", 1).lstrip("-").isdigit():
        values.insert(0, float(cells.pop()))
    return values


def test_memory_estimate_uses_the_runtime_dtype_and_kv_cache():
    gpu = memory("ppo_llama70b")
    # bf16 weights (the rollout computes in the training dtype): 70.554B * 2 bytes / tp 8
    weights, peak, kv = (_row(gpu, name)[0] for name in ("vLLM weights", "vLLM activation peak", "vLLM KV cache"))
    assert weights == pytest.approx(16.43, abs=0.01)
    # vLLM takes 0.35 of the device's 79.19 GiB and gives the KV cache what weights and peak leave
    assert kv == pytest.approx(0.35 * 79.19 - weights - peak, abs=0.02) and 0.5 < peak < 3
    too_small = memory("ppo_llama70b", "rollout.gpu_memory_utilization=0.2")
    assert "vLLM gets no KV cache" in too_small and "does NOT fit" in too_small
    cpu = memory("ppo_tiny")
    assert _row(cpu, "vLLM KV cache (rollout.kv_cache_bytes; on CPU at most)") == [0.25]  # CPU default 256 MiB
    assert "no verdict" in cpu and "CUDA context" not in cpu


def test_llama70b_per_stage_arithmetic_by_hand():
    text = memory("ppo_llama70b")
    # one decoder layer: 2 norms (8192 each, replicated over tp) + q, o (8192^2) + k, v (8192 x 1024)
    # + gate, up, down (8192 x 28672), the matrices split over tp 8
    matrices = 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    layer = 2 * 8192 + matrices // 8
    middle = 20 * layer  # 80 layers over pp 4
    first = middle + 128256 * 8192 // 8  # + the vocab-parallel embedding
    last = middle + 8192 + 128256 * 8192 // 8  # + final norm and LM head
    # megatron bf16: 2 (weights) + 4 (fp32 grad buffer) + (4 main + 8 Adam) / dp 4 = 9 bytes per parameter
    assert _row(text, "actor weights, fp32 grads") == pytest.approx(
        [9 * first / GiB, 9 * middle / GiB, 9 * middle / GiB, 9 * last / GiB], abs=0.01)
    assert _row(text, "reference weights") == pytest.approx([2 * n / GiB for n in (first, middle, middle, last)],
                                                            abs=0.01)
    # activations per token and layer on a tp rank (sequence parallel: norms / 8): two norms
    # 2 * (8 * 8192 + 4 + 2 * 8192) / 8, rotary 4 * 2 * 128, q/k/v/context 4 * 2 * 8192 / 8 and the
    # scores 64 heads * 2048 * (4 fp32 + 2 bf16) / 8, MLP 5 * 2 * 28672 / 8; a 2048-byte mask row
    per_token_layer = 2 * (8 * 8192 + 4 + 2 * 8192) / 8 + 4 * 2 * 128 + (4 * 2 * 8192 + 64 * 2048 * 6) / 8 \
        + 5 * 2 * 28672 / 8
    stage0 = 2048 * (20 * per_token_layer + 2048) * 4  # 1F1B: 4 micro-batches of 2048 tokens in flight
    acts = _row(text, "actor activations")
    assert acts[0] == pytest.approx(stage0 / GiB, abs=0.01) and acts[0] == pytest.approx(25.02, abs=0.01)
    assert acts[1] == pytest.approx(stage0 * 3 / 4 / GiB, abs=0.01)  # 3 in flight
    assert _row(text, "CUDA context") == [2.0] * 4
    # recompute: each in-flight micro-batch keeps its 20 layer inputs (2 * 8192 / 8 per token) and
    # the mask; one layer's activations are live again during its backward
    ckpt = memory("ppo_llama70b", "actor.activation_checkpointing=true", "critic.activation_checkpointing=true")
    recomputed = 2048 * (4 * (20 * 2 * 8192 / 8 + 2048) + per_token_layer)
    assert _row(ckpt, "actor activations")[0] == pytest.approx(recomputed / GiB, abs=0.01)


def test_grpo_qwen7b_numbers_and_fp32_sync():
    cfg = validate(load_config("grpo_qwen7b", ["trainer.dry_run=true"]))
    text = describe_run(cfg)
    # fsdp dp 8 x tp 2: 16 bytes (fp32 weights, grads, 2 Adam moments) per parameter / 16 ranks
    assert _row(text, "actor fp32 weights") == pytest.approx([7.09], abs=0.01)
    # 4 samples x 3072 tokens; per token and layer: norms 2 * (4 * 3584 + 4 + 2 * 2 * 3584) (replicated),
    # attention (2 * (2 * 3584 + 2 * 512) + 4 * 28) / 2, MLP 4 * 2 * 18944 / 2; the LM head: final norm
    # + fp32 logits 4 * 76032 saved, (8 + 2) * 76032 more in its backward
    layer = 2 * (4 * 3584 + 4 + 4 * 3584) + (2 * (2 * 3584 + 2 * 512) + 4 * 28) / 2 + 4 * 2 * 18944 / 2
    head = 4 * 3584 + 4 + 4 * 3584 + 14 * 152064 / 2
    assert _row(text, "actor activations") == pytest.approx([12288 * (28 * layer + head) / GiB], abs=0.01)
    assert _row(text, "actor activations") == pytest.approx([57.81], abs=0.01)
    # the actor casts fsdp's fp32 shards to the bf16 vLLM computes with before sending
    line = next(l for l in text.splitlines() if l.startswith("resharding"))
    assert "in bfloat16 as the rollout computes" in line
    mean = float(line.split("GiB, mean ")[1].split(" GiB")[0])
    assert mean == pytest.approx(6.206, abs=0.001)
    low = memory("grpo_qwen7b", "resources.device_memory_gib=70")
    assert "device 70.00 GiB: resources.device_memory_gib" in low and "of 70.00: does NOT fit" in low


def test_dry_run_and_actor_pick_the_same_generation_layout():
    from rlframe.plan.dry_run import layouts
    from rlframe.resharding.layout import generation_layout

    cfg = validate(load_config("ppo_tiny", ["trainer.dry_run=true", "actor.strategy=megatron", "actor.dp=1",
                                            "actor.tp=2", "critic.strategy=megatron", "critic.dp=1", "critic.tp=2"]))
    train, gen, scheme = layouts(cfg)
    assert scheme.startswith("HybridFlow") and (gen, scheme) == generation_layout(train, tp=cfg.rollout.tp)


def test_split_fanout_line_counts_what_the_training_ranks_send():
    """Four generation replicas of the 50m preset (tp 1: each holds the whole model): direct fan-out sends the
    model four times from the training ranks; chain sends it once and the replicas forward it three times."""
    split = ["trainer.dry_run=true", "model.tiny_preset=50m", "resources.placement=split", "resources.procs_per_node=6",
             "resources.split_procs={actor:2,rollout:4}"]
    lines = {}
    for mode in ("direct", "chain"):
        text = describe_run(validate(load_config("grpo_tiny", split + [f"rollout.weight_fanout={mode}"])))
        lines[mode] = next(l for l in text.splitlines() if l.startswith("weight fan-out"))
    chain = lines["chain"]
    sent = float(chain.split("send ")[1].split(" GiB")[0])
    forwarded = float(chain.split("forward ")[1].split(" GiB")[0])
    direct = float(chain.split("(direct: ")[1].split(" GiB")[0])
    assert direct == pytest.approx(4 * sent, rel=0.01) and forwarded == pytest.approx(3 * sent, rel=0.01)
    assert f"send {direct:.3f} GiB per sync (chain: {sent:.3f} GiB" in lines["direct"]
    assert "4 replica(s)" in chain and "shared-memory rings (one host)" in chain


def test_the_dry_run_says_what_defines_the_algorithm():
    """dapo, gspo and rloo were all "advantage estimator grpo|rloo, 4 sample(s) per prompt, critic off,
    reference on": the dry run now prints what sets them apart (clip range, loss aggregation, where
    the KL acts and its coefficient, dynamic sampling, overlong shaping, epochs and mini-batches)."""
    from rlframe.plan.dry_run import algorithm_lines

    def lines(*overrides):
        return "\n".join(algorithm_lines(validate(load_config("ppo_tiny", ["trainer.dry_run=true", *overrides]))))

    dapo = lines("algorithm=dapo")
    assert "policy loss ppo: ratio clipped to [0.8, 1.28] (algorithm.clip_ratio_low 0.2, clip_ratio_high 0.28)" in dapo
    assert "loss aggregation token-mean" in dapo and "KL to the reference: none" in dapo
    assert "dynamic sampling on" in dapo and "up to 4 generation batches" in dapo
    assert "overlong shaping over the last 2 response tokens (penalty factor 1)" in dapo
    assert "actor update: 1 epoch(s) x 1 mini-batch(es) of 256 samples (256 per step)" in dapo
    gspo = lines("algorithm=gspo")
    assert "policy loss gspo: ratio clipped to [0.9997, 1.0004]" in gspo
    assert "loss aggregation seq-mean-token-mean" in gspo and "dynamic sampling off; overlong shaping off" in gspo
    rloo = lines("algorithm=rloo", "actor.ppo_epochs=2", "actor.mini_batch_size=64")
    assert "the policy loss's own: algorithm.loss_agg_mode=null" in rloo and "KL to the reference: none" in rloo
    assert "2 epoch(s) x 4 mini-batch(es) of 64 samples (256 per step) = 8 optimizer step(s)" in rloo
    assert "KL to the reference: in the loss, algorithm.kl_loss_coef 0.001, estimator k3" in lines("algorithm=grpo")
    assert ("in the reward, algorithm.kl_coef 0.05 (adaptive to kl_target 0.1 over kl_horizon 10000), estimator k1"
            in lines("algorithm.kl_in_reward=true", "algorithm.kl_coef=0.05", "algorithm.kl_target=0.1"))
    assert "DPO on pairs" in lines("algorithm=online_dpo")
    # in the dry run's report, under its algorithm line
    out = describe_run(validate(load_config("ppo_tiny", ["trainer.dry_run=true", "algorithm=dapo"]))).splitlines()
    assert out[0].startswith("algorithm: dapo") and out[1].startswith("  policy loss ppo: ratio clipped")
