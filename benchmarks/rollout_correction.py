"""Held-out accuracy by staleness and off-policy correction (rlframe/algos/rollout_correction.py).

    python benchmarks/rollout_correction.py [--workload demo|series] [--steps 40] [--ks 0,2,4] [--seeds 0,1] [--no-write]

`demo`: GRPO on the demo task, split placement (actor, reference and vLLM each in a process of its
own), as shipped but for the staleness bound and the correction: synchronous (k=0, where every
correction is inert: the batch is on-policy) and with generation up to k batches ahead
(trainer.max_staleness=k, the batch pipeline). `series`: GRPO without KL on the series task
(configs/grpo_series.yaml; actor and vLLM in a process each), and for k > 0 streaming rollouts
(trainer.async_mode=stream, rounds of 128 tokens): the generation-bound workload of docs/async.md.
For each correction (none, behaviour, tis = decoupled PPO, icepop, mis, seq_mask_tis), with each seed
of --seeds. Reported: held-out greedy accuracy after --steps steps (mean and range over seeds), the
share of tokens the masking corrections left out of the update (mean over steps), and a plot, in
docs/benchmarks.md. Runs share the claims' run cache (benchmarks/claims/.runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "claims"))

from common import FIGURES, at_step, machine_state, run_job, save_figure, spread  # noqa: E402
from report import markdown_table, reproduce_line, write_section  # noqa: E402

METHODS = ("none", "behaviour", "tis", "icepop", "mis", "seq_mask_tis")


@dataclass(frozen=True)
class Workload:
    config: str
    split: list[str]  # the placement of every run
    off_policy: list[str]  # added to the runs with k > 0
    section: str
    figure: Path
    title: str  # the plot's
    what: str  # the workload, in the table's caption


WORKLOADS = {
    "demo": Workload("grpo_tiny", ["algorithm=grpo", "resources.placement=split", "actor.dp=1",
                                   "+resources.split_procs={actor: 1, ref: 1, rollout: 1}"], [],
                     "## Off-policy corrections by staleness (held-out accuracy)", FIGURES / "rollout_correction.png",
                     "GRPO on the demo task", "GRPO on the demo task (the pinned pre-trained demo model, 37.9% at step 0), split placement, "
                     "the batch pipeline"),
    "series": Workload("grpo_series", ["resources.placement=split", "actor.dp=1",
                                       "+resources.split_procs={actor: 1, rollout: 1}"],
                       ["trainer.async_mode=stream", "rollout.partial_budget=128"],
                       "## Off-policy corrections by staleness, streaming (series task)",
                       FIGURES / "rollout_correction_series.png", "GRPO on the series task, streaming",
                       "GRPO without KL on the series task (the shipped series model), split placement, streaming "
                       "rollouts in rounds of 128 tokens"),
}


def plot(final: dict, ks: list[int], path: Path, title: str, methods: tuple[str, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, method in enumerate(methods):
        xs = [k + (i - len(methods) / 2) * 0.06 for k in ks]  # side by side at each k
        vals = [final[(method, k)] for k in ks]
        means = [statistics.fmean(v) for v in vals]
        ax.errorbar(xs, means, yerr=[[m - min(v) for m, v in zip(means, vals)], [max(v) - m for m, v in zip(means, vals)]],
                    marker="o", capsize=3, label=method)
    ax.set(xlabel="staleness bound k (trainer.max_staleness)", ylabel="held-out accuracy (greedy)", xticks=ks,
           title=f"{title}: accuracy after training, mean and range over seeds")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=list(WORKLOADS), default="demo")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ks", default="0,2,4")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--methods", default=",".join(METHODS), help="the corrections to compare (comma-separated)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    ks, seeds = [int(k) for k in args.ks.split(",")], [int(s) for s in args.seeds.split(",")]
    work = WORKLOADS[args.workload]
    methods = tuple(args.methods.split(","))
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"--methods {sorted(unknown)}: choose from {','.join(METHODS)}")
    before = machine_state()
    print(f"load {before['load1']:.1f}, fp32 matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    final: dict[tuple[str, int], list[float]] = {}
    masked: dict[tuple[str, int], list[float]] = {}
    stale: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for k in ks:
                # k=0 is on-policy: every correction is the same run, made once and shared
                for method in (methods if k else ("none",)):
                    rows = run_job([*work.split, *(work.off_policy if k else []), f"trainer.max_staleness={k}",
                                    f"algorithm.off_policy_correction={method}", f"trainer.total_steps={args.steps}",
                                    "trainer.val_every=10"],
                                   seed=seed, out=Path(tmp), name=f"{method}_k{k}", config=work.config)
                    accuracy = at_step(rows, "val/accuracy", args.steps)
                    for m in (methods if not k else (method,)):
                        final.setdefault((m, k), []).append(accuracy)
                    share = [r["async/masked_token_frac"] for r in rows if "async/masked_token_frac" in r]
                    if share:
                        masked.setdefault((method, k), []).append(statistics.fmean(share))
                    if k:  # how stale the trained batches were (generation-bound runs stay below the bound)
                        ages = [r["async/staleness"] for r in rows if "async/staleness" in r]
                        stale.setdefault(k, []).append(statistics.fmean(ages))
                    print(f"  seed {seed} k={k} {method}: {accuracy:.1%}", flush=True)
    after = machine_state()
    header = ["correction", *(f"k={k}" for k in ks), *(f"tokens masked, k={k}" for k in ks if k)]
    table = markdown_table(header, [[m, *(spread(final[(m, k)], ".1%") for k in ks),
                                     *(spread(masked[(m, k)], ".1%") if (m, k) in masked else "-" for k in ks if k)]
                                    for m in methods])
    best = {k: max(methods, key=lambda m: statistics.fmean(final[(m, k)])) for k in ks if k}
    summary = ("Best mean accuracy per staleness: " + ", ".join(f"k={k}: {m}" for k, m in best.items())
               + ". k=0 is one synchronous run per seed (no correction applies on-policy), repeated in each row. "
               + "Staleness of the trained batches, mean over steps and runs: "
               + ", ".join(f"k={k}: {statistics.fmean(v):.2f} (runs {min(v):.2f}-{max(v):.2f})" for k, v in stale.items())
               + ".")
    print(table + "\n" + summary)
    body = "\n".join([
        reproduce_line(f"python benchmarks/rollout_correction.py --workload {args.workload} --steps {args.steps} "
                       f"--ks {args.ks} --seeds {args.seeds}"
                       + (f" --methods {args.methods}" if methods != METHODS else ""), before, after), "",
        f"{work.what}, {args.steps} steps, held-out greedy accuracy at the end, mean (range) over seeds {args.seeds}; the corrections at their "
        "defaults (tis_cap 2, icepop band [0.5, 5], mis and seq_mask_tis band [0.5, 2]) (docs/async.md).", "",
        table, "", summary, "", f"![accuracy by staleness and correction](img/{work.figure.name})"])
    if not args.no_write:
        plot(final, ks, work.figure, work.title, methods)
        write_section(work.section, body)


if __name__ == "__main__":
    main()
