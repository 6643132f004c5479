"""Asynchronous RLHF in small: held-out accuracy vs staleness k for PPO, GRPO and online DPO.

    python examples/async_offpolicy/run.py                 # k in {0, 1, 2, 4}, 3 algorithms, writes results
    python examples/async_offpolicy/run.py --steps 10 --ks 0,1 --algos grpo --no-write

Every run: the tiny arithmetic task and demo model, split placement (actor, reference, critic when
PPO, and vLLM each in their own process), the same data, seed and number of steps; only the
staleness bound k (trainer.max_staleness; 0 = synchronous) differs. The off-policy correction is
the PPO ratio against the current weights' log-probs with truncated importance weights (tis) for
PPO and GRPO; online DPO takes the stale pairs as they are (its config group's lr, 2e-5). Writes results.md and staleness.png
here: final held-out greedy accuracy and training wall time per (algorithm, k), and accuracy vs
wall time. One run per cell: the spread between seeds is not measured here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

SPLIT = ["resources.placement=split", "actor.dp=1", "critic.dp=1"]
TIS = "algorithm.off_policy_correction=tis"  # the PPO family's ratio correction; online DPO's loss has no ratio
ALGOS = {
    "ppo": ("ppo_tiny", ["+resources.split_procs={actor: 1, critic: 1, ref: 1, rollout: 1}", TIS]),
    "grpo": ("grpo_tiny", ["+resources.split_procs={actor: 1, ref: 1, rollout: 1}", TIS]),
    "online_dpo": ("grpo_tiny", ["+resources.split_procs={actor: 1, ref: 1, rollout: 1}", "algorithm=online_dpo"]),
}


def run(algo: str, k: int, *, steps: int, out: Path) -> list[dict]:
    config, extra = ALGOS[algo]
    name = f"{algo}_k{k}"
    cmd = [sys.executable, "-m", "rlframe.main", "--config-name", config, *SPLIT, *extra,
           f"trainer.max_staleness={k}", f"trainer.total_steps={steps}",
           f"trainer.val_every={max(1, steps // 4)}", "trainer.save_every=0", "trainer.export_hf=false",
           "trainer.plot=false", "trainer.resume=off", "trainer.progress_bar=false", "trainer.loggers=[jsonl]",
           f"trainer.output_dir={out}", f"trainer.experiment={name}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def curve(rows: list[dict]) -> list[tuple[float, float]]:
    clock, points = 0.0, [(0.0, rows[0]["val/accuracy"])]
    for r in rows[1:]:
        clock += r["timing_s/step"]
        if "val/accuracy" in r:
            points.append((clock, r["val/accuracy"]))
    return points


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ks", default="0,1,2,4")
    ap.add_argument("--algos", default="ppo,grpo,online_dpo")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    algos = args.algos.split(",")
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in algos:  # k alternates within an algorithm so background load hits all k alike
            for k in ks:
                results[(algo, k)] = curve(run(algo, k, steps=args.steps, out=Path(tmp)))
                start, end = results[(algo, k)][0][1], results[(algo, k)][-1]
                print(f"{algo} k={k}: {start:.1%} -> {end[1]:.1%} in {end[0]:.1f} s of training", flush=True)
    lines = ["| algorithm | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for algo in algos:
        cells = []
        for k in ks:
            (_, start), (clock, end) = results[(algo, k)][0], results[(algo, k)][-1]
            cells.append(f"{start:.1%} -> **{end:.1%}** ({clock:.0f} s)")
        lines.append(f"| {algo} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(algos), figsize=(4 * len(algos), 3.5), squeeze=False)
    for ax, algo in zip(axes[0], algos):
        for k in ks:
            xs, ys = zip(*results[(algo, k)])
            ax.plot(xs, ys, marker="o", label=f"k={k}")
        ax.set_title(algo)
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("held-out greedy accuracy")
        ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "staleness.png", dpi=100)
    (HERE / "results.md").write_text(
        f"`python examples/async_offpolicy/run.py --steps {args.steps} --ks {args.ks} --algos {args.algos}`\n\n"
        f"Held-out greedy accuracy at step 0 -> after {args.steps} steps (training wall time), one run each:\n\n"
        f"{table}\n\n![accuracy vs wall time per staleness bound](staleness.png)\n")


if __name__ == "__main__":
    main()
