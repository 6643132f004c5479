"""The plain data-parallel engine plugin (examples/plugins/ddp_engine.py) against the fsdp engine, written
to docs/benchmarks.md.

    python benchmarks/ddp_engine.py [--presets demo,12m] [--batch 16] [--steps 7] [--no-write]

Two gloo ranks x one thread run both engines at dp2 on the same model and batch (mixed lengths, one
micro-batch per rank): a forward-only log-prob pass (what old, reference and rollout-check log-probs
cost) and a training step, timed round-robin (fsdp, ddp, fsdp, ...) after one warm-up each, so load
changes hit both alike. The fsdp engine runs its CPU defaults (each layer gathered once per step,
shared-memory collectives); ddp holds the whole model on each rank and all-reduces the gradients once.
Printed with the 1-minute load average and the fp32 matmul rate before and after.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import machine_line, machine_state, markdown_table, write_section  # noqa: E402
from train_step import _loss, make_batch  # noqa: E402

SECTION = "## Plain data parallelism (the ddp engine plugin)"
ENGINES = ("fsdp", "ddp")


def _bench(rank, world, path, batch_kw, steps):
    import torch

    import examples.plugins.ddp_engine  # noqa: F401  (registers "ddp")
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    batch = make_batch(**batch_kw)
    n = batch["input_ids"].shape[0] // world
    mine = {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}
    engines = {name: get_train_engine(name)(TrainEngineConfig(model_path=path, dp=world, lr=1e-5)) for name in ENGINES}
    times = {(name, op): [] for name in ENGINES for op in ("log_probs", "train_step")}

    def timed(name, op):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        if op == "log_probs":
            engines[name].forward_log_probs(mine, temperature=0.7)
        else:
            engines[name].train_step(_loss, mine)
        torch.distributed.barrier()
        return time.perf_counter() - t0

    for name in ENGINES:  # warm-up
        timed(name, "log_probs"), timed(name, "train_step")
    for _ in range(steps):
        for op in ("log_probs", "train_step"):
            for name in ENGINES:
                times[(name, op)].append(timed(name, op))
    return {f"{name}/{op}": t for (name, op), t in times.items()}


def run(presets, batch_size: int, steps: int) -> str:
    from rlframe.data.tiny_model import build_random_model, count_parameters
    from rlframe.utils.spawn import run_distributed

    before = machine_state()
    print(f"load {before['load1']:.1f}, fp32 matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            path = str(build_random_model(Path(tmp) / preset, preset=preset, seed=0))
            batch_kw = dict(batch_size=batch_size, prompt_len=64, response_len=128, vocab=100)
            times = run_distributed(_bench, world_size=2, args=(path, batch_kw, steps), timeout_s=1800,
                                    env={"RLFRAME_THREADS_PER_RANK": "1"})[0]
            for op in ("log_probs", "train_step"):
                f, d = times[f"fsdp/{op}"], times[f"ddp/{op}"]
                rows.append([preset, f"{count_parameters(preset) / 1e6:.2f}M", op.replace("_", " "),
                             f"{statistics.median(f):.3f} ({min(f):.3f}-{max(f):.3f})",
                             f"{statistics.median(d):.3f} ({min(d):.3f}-{max(d):.3f})",
                             f"{statistics.median(f) / statistics.median(d):.2f}x"])
                print(rows[-1], flush=True)
    after = machine_state()
    head = (f"{machine_line()} Load average {before['load1']:.1f} before, {after['load1']:.1f} after; fp32 matmul "
            f"{before['gflops']:.0f} / {after['gflops']:.0f} GFLOP/s (2 threads). Two gloo ranks x 1 thread, dp2, fp32; "
            f"batch {batch_size} sequences (prompts 16-64 + responses 16-128 tokens), one micro-batch per rank; "
            f"{steps} timed rounds after a warm-up, the engines alternating; seconds, median (min-max).")
    table = markdown_table(["preset", "parameters", "pass", "fsdp s", "ddp s", "fsdp / ddp"], rows)
    return f"{head}\n\n{table}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="demo,12m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()
    body = run(args.presets.split(","), args.batch, args.steps)
    print(body)
    if not args.no_write:
        command = f"python benchmarks/ddp_engine.py --presets {args.presets} --batch {args.batch} --steps {args.steps}"
        write_section(SECTION, f"Reproduce: `{command}`.\n\n{body}")


if __name__ == "__main__":
    main()
