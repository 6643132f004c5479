"""Held-out accuracy by staleness and off-policy correction (rlframe/algos/rollout_correction.py).

    python benchmarks/rollout_correction.py [--steps 40] [--ks 0,2,4] [--seeds 0,1] [--no-write]

GRPO on the demo task, split placement (actor, reference and vLLM each in a process of its own), as
shipped but for the staleness bound and the correction: synchronous (k=0, where every correction is
inert: the batch is on-policy) and with generation up to k steps ahead (trainer.max_staleness=k),
for each correction (none, behaviour, tis = decoupled PPO, icepop, mis, seq_mask_tis), with each seed
of --seeds. Reported: held-out greedy accuracy after --steps steps (mean and range over seeds), the
share of tokens the masking corrections left out of the update (mean over steps), and a plot, in
docs/benchmarks.md. Runs share the claims' run cache (benchmarks/claims/.runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "claims"))

from common import FIGURES, at_step, machine_state, run_job, save_figure, spread  # noqa: E402
from report import markdown_table, reproduce_line, write_section  # noqa: E402

SECTION = "## Off-policy corrections by staleness (held-out accuracy)"
SPLIT = ["algorithm=grpo", "resources.placement=split", "actor.dp=1",
         "+resources.split_procs={actor: 1, ref: 1, rollout: 1}"]
METHODS = ("none", "behaviour", "tis", "icepop", "mis", "seq_mask_tis")
FIGURE = FIGURES / "rollout_correction.png"


def plot(final: dict, ks: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, method in enumerate(METHODS):
        xs = [k + (i - len(METHODS) / 2) * 0.06 for k in ks]  # side by side at each k
        vals = [final[(method, k)] for k in ks]
        means = [statistics.fmean(v) for v in vals]
        ax.errorbar(xs, means, yerr=[[m - min(v) for m, v in zip(means, vals)], [max(v) - m for m, v in zip(means, vals)]],
                    marker="o", capsize=3, label=method)
    ax.set(xlabel="staleness bound k (trainer.max_staleness)", ylabel="held-out accuracy (greedy)", xticks=ks,
           title="GRPO on the demo task: accuracy after training, mean and range over seeds")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ks", default="0,2,4")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    ks, seeds = [int(k) for k in args.ks.split(",")], [int(s) for s in args.seeds.split(",")]
    before = machine_state()
    print(f"load {before['load1']:.1f}, fp32 matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    final: dict[tuple[str, int], list[float]] = {}
    masked: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for k in ks:
                # k=0 is on-policy: every correction is the same run, made once and shared
                for method in (METHODS if k else ("none",)):
                    rows = run_job([*SPLIT, f"trainer.max_staleness={k}", f"algorithm.off_policy_correction={method}",
                                    f"trainer.total_steps={args.steps}", "trainer.val_every=10"],
                                   seed=seed, out=Path(tmp), name=f"{method}_k{k}")
                    accuracy = at_step(rows, "val/accuracy", args.steps)
                    for m in (METHODS if not k else (method,)):
                        final.setdefault((m, k), []).append(accuracy)
                    share = [r["async/masked_token_frac"] for r in rows if "async/masked_token_frac" in r]
                    if share:
                        masked.setdefault((method, k), []).append(statistics.fmean(share))
                    print(f"  seed {seed} k={k} {method}: {accuracy:.1%}", flush=True)
    after = machine_state()
    header = ["correction", *(f"k={k}" for k in ks), *(f"tokens masked, k={k}" for k in ks if k)]
    table = markdown_table(header, [[m, *(spread(final[(m, k)], ".1%") for k in ks),
                                     *(spread(masked[(m, k)], ".1%") if (m, k) in masked else "-" for k in ks if k)]
                                    for m in METHODS])
    best = {k: max(METHODS, key=lambda m: statistics.fmean(final[(m, k)])) for k in ks if k}
    summary = ("Best mean accuracy per staleness: " + ", ".join(f"k={k}: {m}" for k, m in best.items())
               + f". k=0 is one synchronous run per seed (no correction applies on-policy), repeated in each row.")
    print(table + "\n" + summary)
    body = "\n".join([
        reproduce_line(f"python benchmarks/rollout_correction.py --steps {args.steps} --ks {args.ks} --seeds {args.seeds}",
                       before, after), "",
        f"GRPO on the demo task (the pinned pre-trained demo model, 37.9% at step 0), split placement, {args.steps} "
        f"steps, held-out greedy accuracy at the end, mean (range) over seeds {args.seeds}; the corrections at their "
        "defaults (tis_cap 2, icepop band [0.5, 5], mis and seq_mask_tis band [0.5, 2]) (docs/placement.md).", "",
        table, "", summary, "", f"![accuracy by staleness and correction](img/{FIGURE.name})"])
    if not args.no_write:
        plot(final, ks, FIGURE)
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
