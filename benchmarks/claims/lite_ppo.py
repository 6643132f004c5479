"""Claim (Liu et al. 2025, "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
arXiv:2508.08221): Lite PPO, two techniques on plain PPO without a critic (advantages normalised by
the group's mean and the batch's standard deviation, token-level loss), matches or beats GRPO and
DAPO.

    python benchmarks/claims/lite_ppo.py [--steps 60] [--no-write]

Three arms, each its algorithm's config group as shipped (configs/algorithm/*.yaml: GRPO with its k3
KL loss, DAPO with clip-higher, dynamic sampling and overlong shaping, Lite PPO), on the default task
(two-digit addition, the tiny demo model, 64 prompts x 4 samples a step), three seeds each
(trainer.seed), arms alternating within a seed. Reported: held-out greedy accuracy over training
(val/accuracy every 10 steps), its mean over the last two evaluations, and seconds per step.
The verdict's words, on the last two evaluations over seeds: Lite PPO "beats" an arm when its worst
seed is above that arm's best, is "ahead of" it when its mean is above that arm's best seed, "falls
behind" it when its mean is below that arm's worst seed (or that arm's mean above its best), and
"matches" it otherwise (each mean within the other's range of seeds).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (FIGURES, SEEDS, claim_args, machine_state, plot_curves, publish, run_job, series,  # noqa: E402
                    spread)

SECTION = "## Lite PPO matches or beats GRPO and DAPO without a critic"
ARMS = {"GRPO": "grpo", "DAPO": "dapo", "Lite PPO": "lite_ppo"}


def late_accuracy(rows: list[dict]) -> float:
    """Mean held-out accuracy over the run's last two evaluations (one evaluation is noisy)."""
    return statistics.fmean(series(rows, "val/accuracy")[1][-2:])


def main() -> None:
    args = claim_args(__doc__)
    before = machine_state()
    runs = {name: [] for name in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in SEEDS:
            for name, algorithm in ARMS.items():
                runs[name].append(run_job([f"algorithm={algorithm}", f"trainer.total_steps={args.steps}",
                                           "trainer.val_every=10"], seed=seed, out=Path(tmp), name=algorithm))
    after = machine_state()
    late = {name: [late_accuracy(rows) for rows in group] for name, group in runs.items()}
    table = ["| algorithm | held-out accuracy, start | last two evaluations | s per step (median) |", "|---|---|---|---|"]
    for name, group in runs.items():
        start = [series(rows, "val/accuracy")[1][0] for rows in group]
        step_s = [statistics.median(series(rows, "timing_s/step")[1]) for rows in group]
        table.append(f"| {name} | {spread(start, '.1%')} | {spread(late[name], '.1%')} | {spread(step_s, '.2f')} |")
    lite = late["Lite PPO"]
    words = []
    for other in ("GRPO", "DAPO"):
        ref = late[other]
        if min(lite) > max(ref):
            words.append(f"beats {other}")
        elif statistics.fmean(lite) > max(ref):
            words.append(f"is ahead of {other}")
        elif statistics.fmean(lite) < min(ref) or statistics.fmean(ref) > max(lite):
            words.append(f"falls behind {other}")
        else:
            words.append(f"matches {other}")
    holds = all(not w.startswith("falls") for w in words)
    gen_batches = statistics.fmean(v for rows in runs["DAPO"] for v in series(rows, "dapo/gen_batches")[1])
    verdict = (f"**{'Reproduces' if holds else 'Does not reproduce'} at this scale**: Lite PPO {' and '.join(words)} "
               f"(last two evaluations: Lite PPO {spread(lite, '.1%')}, GRPO {spread(late['GRPO'], '.1%')}, DAPO "
               f"{spread(late['DAPO'], '.1%')}; mean (range) over seeds {', '.join(map(str, SEEDS))}). Not on the same "
               f"generation budget: DAPO's dynamic sampling generated {gen_batches:.2f} batches per step on average "
               f"(it drops groups whose rewards are all equal and samples more prompts), the others one; the seconds "
               f"per step above show the cost.")
    figure = FIGURES / "claim_lite_ppo.png"
    plot_curves(runs, ["val/accuracy", "actor/entropy"], figure, smooth={"actor/entropy": 3},
                titles={"val/accuracy": "held-out accuracy (greedy)", "actor/entropy": "entropy per token (3-step mean)"})
    publish(SECTION, "lite_ppo.py", args, intro=(
        f"Each algorithm's config group as shipped, two-digit addition (tiny demo model), 64 prompts x 4 samples a "
        f"step, {args.steps} steps, evaluation every 10."), table=table, figure=figure,
        caption="held-out accuracy and entropy over training", verdict=verdict, before=before, after=after)

if __name__ == "__main__":
    main()
