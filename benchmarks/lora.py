"""LoRA against full fine-tuning on this machine: training memory and step time, and the weight sync
into vLLM per step (bytes and time), written to docs/benchmarks.md.

    python benchmarks/lora.py [--preset 50m] [--rank 16] [--steps 4] [--syncs 5] [--rounds 2] [--no-write]

Each configuration (full, LoRA) runs in its own fresh pair of spawned gloo ranks (one thread each),
the hybrid engine's layout: the fsdp engine at dp=2 and, in the same processes, a vLLM engine per
rank (rollout tp=1, two data-parallel replicas), as the actor has them. Per configuration:
- training: one warm-up step, then `--steps` timed `train_step`s (batch 16, prompts 16-64 + responses
  16-128 tokens); the peak resident memory of the rank (ru_maxrss) once the engine is built and after
  the steps (before vLLM is built), and the optimizer state and gradient bytes it holds;
- sync: the actor's sync (resharding plan into vLLM's slices, executed bucket by bucket into
  `weight_update()` or, with LoRA, `lora_update()`), `--syncs` times after one warm-up: bytes each
  rank receives (the plan's minimum) and the median time.
The configurations alternate over `--rounds` rounds (each a fresh spawn), so load changes on the
shared machine hit both alike; medians and ranges are over all rounds' timed steps.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import machine_line, machine_state, markdown_table, write_section  # noqa: E402
from train_step import _loss, make_batch  # noqa: E402

SECTION = "## LoRA (adapter-only training and sync)"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _bench(rank, world, path, lora_rank, batch_kw, steps, syncs):
    import torch

    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    lora = dict(lora_rank=lora_rank, lora_alpha=2.0 * lora_rank, lora_target_modules=TARGETS) if lora_rank else {}
    engine = get_train_engine("fsdp")(TrainEngineConfig(model_path=path, dp=2, tp=1, lr=1e-5, **lora))
    built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    batch = make_batch(**batch_kw)
    n = batch["input_ids"].shape[0] // world
    mine = {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}
    engine.train_step(_loss, mine)  # warm-up: optimizer state exists from here
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.train_step(_loss, mine)
        torch.distributed.barrier()
        times.append(time.perf_counter() - t0)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    opt_bytes = sum(_local_bytes(t) for s in engine.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    grad_bytes = sum(_local_bytes(p) for p in trainable)  # one gradient per trainable parameter (this rank's shard)

    from rlframe.resharding.executor import execute_plan  # vLLM's imports after the training peak
    from rlframe.resharding.layout import generation_layout
    from rlframe.workers.rollout import RolloutConfig
    from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine
    from rlframe.workers.weight_plan import vllm_plan

    rollout = VLLMRolloutEngine(path, config=RolloutConfig(backend="vllm", max_model_len=256, kv_cache_bytes=64 << 20,
                                                           **lora))
    src = engine.resharding_layout()
    dst, _ = generation_layout(src, tp=1)
    metas = engine.lora_param_metas() if lora_rank else engine.param_metas()
    plan = vllm_plan(metas, src=src, dst=dst, model_path=path)
    config = {"r": lora_rank, "lora_alpha": 2.0 * lora_rank, "target_modules": list(TARGETS)}
    sync_times, received = [], 0
    for i in range(syncs + 1):
        shards = engine.lora_local_shards() if lora_rank else engine.local_shards()
        local = {name: t for name, (_, _, t) in shards.items()}
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with (rollout.lora_update(config) if lora_rank else rollout.weight_update()) as consume:
            stats = execute_plan(plan, local=local, consumer=consume, bucket_bytes=256 << 20)
        torch.distributed.barrier()
        if i:
            sync_times.append(time.perf_counter() - t0)
        received = stats.bytes_received
    rollout.shutdown()
    return {"step_times": times, "peak_rss": peak_rss, "built_rss": built_rss, "sync_times": sync_times,
            "opt_bytes": opt_bytes, "grad_bytes": grad_bytes, "trainable": grad_bytes // 4,
            "sync_bytes": received, "planned_bytes": plan.bytes_received(rank)}


def _local_bytes(t) -> int:
    """Bytes of this rank's part of `t` (a DTensor's local shard)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def run(preset: str, lora_rank: int, steps: int, syncs: int, rounds: int) -> tuple[str, list[list]]:
    from rlframe.data.tiny_model import build_random_model, count_parameters
    from rlframe.utils.spawn import run_distributed

    batch_kw = dict(batch_size=16, prompt_len=64, response_len=128, vocab=100)
    before = machine_state()
    print(f"load {before['load1']:.1f}, matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_random_model(Path(tmp) / preset, preset=preset, seed=0))
        for _ in range(rounds):  # alternating, so that load changes on the shared CPU hit both alike
            for name, r in (("full fine-tuning", 0), (f"LoRA r={lora_rank}", lora_rank)):
                per_rank = run_distributed(_bench, world_size=2, args=(path, r, batch_kw, steps, syncs),
                                           timeout_s=1800, env={"RLFRAME_THREADS_PER_RANK": "1"})
                # the slower rank sets each step (ranks meet at barriers); memory: the larger rank
                got = {"step_times": [max(ts) for ts in zip(*(p["step_times"] for p in per_rank))],
                       "sync_times": [max(ts) for ts in zip(*(p["sync_times"] for p in per_rank))],
                       **{k: max(p[k] for p in per_rank) for k in per_rank[0] if not k.endswith("_times")}}
                agg = results.setdefault(name, {"step_times": [], "sync_times": []})
                agg["step_times"] += got.pop("step_times")
                agg["sync_times"] += got.pop("sync_times")
                for k, v in got.items():
                    agg[k] = max(agg.get(k, v), v)
                print(name, {k: v for k, v in agg.items()}, flush=True)
    after = machine_state()
    mib = 2**20
    rows = []
    for name, r in results.items():
        r["step_s"], r["step_spread"] = statistics.median(r["step_times"]), (min(r["step_times"]), max(r["step_times"]))
        r["sync_s"], r["sync_spread"] = statistics.median(r["sync_times"]), (min(r["sync_times"]), max(r["sync_times"]))
        assert r["sync_bytes"] == r["planned_bytes"], (name, r["sync_bytes"], r["planned_bytes"])
        rows.append([name, f"{r['trainable'] / 1e6:.3f}M", f"{r['opt_bytes'] / mib:.1f}", f"{r['grad_bytes'] / mib:.1f}",
                     f"{r['built_rss'] / mib:.0f} -> {r['peak_rss'] / mib:.0f}",
                     f"{r['step_s']:.2f} ({r['step_spread'][0]:.2f}-{r['step_spread'][1]:.2f})",
                     f"{r['sync_bytes'] / mib:.2f}",
                     f"{1000 * r['sync_s']:.1f} ({1000 * r['sync_spread'][0]:.1f}-{1000 * r['sync_spread'][1]:.1f})"])
    header = ["", "trainable params (per rank)", "optimizer state MiB / rank", "gradients MiB / rank",
              "RSS MiB / rank: model built -> training peak", "train step s, median (range)", "sync MiB received / rank",
              "sync ms, median (range)"]
    text = "\n".join([
        f"`python benchmarks/lora.py --preset {preset} --rank {lora_rank}`: the `{preset}` preset "
        f"({count_parameters(preset) / 1e6:.1f}M parameters), fp32, the hybrid engine's layout (fsdp dp=2 and a "
        f"vLLM engine in each of 2 gloo ranks, one thread each); LoRA on q/k/v/o/gate/up/down with alpha = 2r. "
        f"{rounds} rounds, the two configurations alternating, each in fresh processes; medians over all rounds. "
        f"Training: {steps} timed steps per round after a warm-up (batch 16, prompts 16-64 + responses 16-128 tokens). "
        f"Sync: the actor's resharding plan into vLLM (adapters only with LoRA), {syncs} timed after a warm-up; "
        "bytes received = the plan's minimum (checked). RSS: the rank's peak resident memory (ru_maxrss) once "
        "the engine is built, and after the training steps (before vLLM is built; imports included). "
        f"1-minute load average {before['load1']:.1f} before, {after['load1']:.1f} "
        f"after; fp32 matmul {before['gflops']:.0f} / {after['gflops']:.0f} GFLOP/s (2 threads) before / after. "
        + machine_line(),
        "",
        markdown_table(header, rows),
    ])
    return text, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="50m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    text, _ = run(args.preset, args.rank, args.steps, args.syncs, args.rounds)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
