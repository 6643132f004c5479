"""Colocated synchronous vs split synchronous vs split asynchronous (k = 1, 2) PPO on this machine.

    python benchmarks/async.py                  # the default budget (60 steps), writes docs/benchmarks.md
    python benchmarks/async.py --steps 20 --no-write

Every run is `python -m rlframe.main` (configs/ppo_tiny.yaml: the demo model, 128 prompts per step,
PPO with a critic) with the same data, seed and step budget; only the placement differs:
- colocated: 2 processes, each with actor (fsdp dp2), critic, reference and vLLM (the hybrid engine);
- split: actor (1 process), critic (1), reference (1), vLLM (1) in their own groups, weights pushed
  over the channel after each update;
- split async k: as split, with trainer.max_staleness=k (TIS correction, cap 2);
- split stream k=2: as split, streaming rollouts (trainer.async_mode=stream) in rounds of 4 tokens.
Runs alternate between the layouts (all layouts, then all again) so background load hits them alike.
Reported per layout (medians over the repeats): the training wall time (sum of the step times,
validation excluded), tokens per second over that time, the wall time at which held-out greedy
accuracy (validation every 10 steps) first reached the target, and the final accuracy. The load
average and the fp32 matmul rate are printed before and after; a plot goes to docs/async.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import machine_state, markdown_table, write_section  # noqa: E402

SECTION = "## Split placement and asynchronous training (PPO, tiny task)"
SPLIT = ["resources.placement=split", "+resources.split_procs={actor: 1, critic: 1, ref: 1, rollout: 1}",
         "actor.dp=1", "critic.dp=1"]
LAYOUTS = {
    "colocated sync": [],
    "split sync": SPLIT,
    "split async k=1": SPLIT + ["trainer.max_staleness=1", "algorithm.off_policy_correction=tis"],
    "split async k=2": SPLIT + ["trainer.max_staleness=2", "algorithm.off_policy_correction=tis"],
    # streaming rollouts (docs/placement.md): rounds of 4 tokens, above most of this task's responses
    "split stream k=2": SPLIT + ["trainer.max_staleness=2", "trainer.async_mode=stream", "rollout.partial_budget=4",
                                 "algorithm.off_policy_correction=tis"],
}


def run_once(name: str, overrides: list[str], *, steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "rlframe.main", *overrides, f"trainer.total_steps={steps}", "trainer.val_every=10",
           "trainer.save_every=0", "trainer.export_hf=false", "trainer.plot=false", "trainer.resume=off",
           "trainer.progress_bar=false", "trainer.loggers=[jsonl]", f"trainer.output_dir={out}",
           f"trainer.experiment={name.replace(' ', '_').replace('=', '')}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_dir = out / name.replace(" ", "_").replace("=", "")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows}


def summarize(rows: list[dict], *, target: float) -> dict:
    steps = [r for r in rows if r["step"] >= 1]
    clock, curve, reached = 0.0, [(0.0, rows[0].get("val/accuracy", float("nan")))], None
    for r in steps:
        clock += r["timing_s/step"]
        if "val/accuracy" in r:
            curve.append((clock, r["val/accuracy"]))
            if reached is None and r["val/accuracy"] >= target:
                reached = clock
    tokens = sum(r["perf/total_num_tokens"] for r in steps)
    return {"train_s": clock, "tokens_per_s": tokens / clock, "reached_s": reached, "final": curve[-1][1],
            "curve": curve, "staleness": max((r.get("async/staleness", 0.0) for r in steps), default=0.0)}


def plot(results: dict[str, list[dict]], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in results.items():
        xs, ys = zip(*runs[0]["curve"])
        ax.plot(xs, ys, marker="o", label=name)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.0%}")
    ax.set_xlabel("training wall time (s, validation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.60)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS),
                    help="a subset of the layouts (the table in docs/benchmarks.md is written only with all of them)")
    args = ap.parse_args()
    layouts = {name: LAYOUTS[name] for name in args.layouts}
    before = machine_state()
    print(f"before: load {before['load1']:.2f}, matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name, overrides in layouts.items():
                res = summarize(run_once(name, overrides, steps=args.steps, out=Path(tmp) / str(rep))["rows"],
                                target=args.target)
                results[name].append(res)
                print(f"{name} run {rep + 1}: {res['train_s']:.1f} s, {res['tokens_per_s']:.0f} tok/s, "
                      f"target at {res['reached_s']}, final {res['final']:.3f}", flush=True)
    after = machine_state()
    print(f"after: load {after['load1']:.2f}, matmul {after['gflops']:.0f} GFLOP/s", flush=True)

    def med(name, key):
        vals = [r[key] for r in results[name] if r[key] is not None]
        return statistics.median(vals) if vals else None

    table = []
    for name in layouts:
        runs = results[name]
        reached = med(name, "reached_s")
        table.append([name, f"{med(name, 'train_s'):.1f} [{min(r['train_s'] for r in runs):.1f}-"
                      f"{max(r['train_s'] for r in runs):.1f}]", f"{med(name, 'tokens_per_s'):.0f}",
                      "not reached" if reached is None else f"{reached:.1f}",
                      " / ".join(f"{r['final']:.1%}" for r in runs), f"{max(r['staleness'] for r in runs):.0f}"])
    header = ["layout", "training wall time s (median [min-max])", "tokens/s",
              f"s to {args.target:.0%} held-out", "final accuracy (each run)", "max staleness"]
    text = markdown_table(header, table)
    print(text)
    if args.no_write or len(layouts) < len(LAYOUTS):
        return
    png = ROOT / "docs" / "async.png"
    plot(results, png, args.target)
    body = (f"`python benchmarks/async.py --steps {args.steps} --repeats {args.repeats}` (PPO, configs/ppo_tiny.yaml; "
            f"{args.repeats} runs per layout, alternating). Load average {before['load1']:.2f} before, "
            f"{after['load1']:.2f} after; fp32 matmul {before['gflops']:.0f} / {after['gflops']:.0f} GFLOP/s.\n\n"
            f"{text}\n\n![accuracy vs wall time](async.png)")
    write_section(SECTION, body)


if __name__ == "__main__":
    main()
