"""Claim (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
arXiv:2503.20783): GRPO's per-response length normalisation biases it towards long wrong answers
(a wrong response's penalty per token shrinks with its length); Dr. GRPO, without it (and without
the std division), keeps incorrect responses from growing.

    python benchmarks/claims/dr_grpo_length.py [--steps 60] [--no-write]

Countdown (the harder task: three numbers, a target, an expression of them; the tiny model
pre-trained on one solution per problem) with room to grow: data.response_length=16, twice the
longest solution. Two arms that differ only in the two normalisations: GRPO with the paper's
objective (loss_agg_mode=seq-mean-token-mean: each response's token mean, std-normalised
advantages) and Dr. GRPO as shipped (token sums over the constant 16, advantages not divided by
the std); neither has a KL term. Three seeds each; reported: the mean length of incorrect and
correct responses in the training batches over the run, and held-out accuracy.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (FIGURES, SEEDS, claim_args, machine_state, plot_curves, publish, run_job, series,  # noqa: E402
                    spread)

SECTION = "## Dr. GRPO removes GRPO's length bias on wrong answers"
TASK = ["data.task=countdown", "data.response_length=16"]
ARMS = {"GRPO (per-response mean)": ["algorithm=grpo", "algorithm.loss_agg_mode=seq-mean-token-mean",
                                     "algorithm.use_kl_loss=false"],
        "Dr. GRPO": ["algorithm=dr_grpo"]}


def window(rows: list[dict], key: str, first: bool) -> float:
    """The mean of `key` over the run's first or last 10 steps (a step's batch is noisy)."""
    values = series(rows, key)[1]
    return statistics.fmean(values[:10] if first else values[-10:])


def main() -> None:
    args = claim_args(__doc__)
    before = machine_state()
    runs = {name: [] for name in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in SEEDS:
            for name, extra in ARMS.items():
                runs[name].append(run_job([*extra, *TASK, f"trainer.total_steps={args.steps}", "trainer.val_every=10"],
                                          seed=seed, out=Path(tmp), name=extra[0].split("=")[1] + "_len",
                                          config="ppo_tiny"))
    after = machine_state()
    key = "response_length/incorrect_mean"
    table = ["| arm | incorrect responses' length, first 10 steps | last 10 steps | change | correct responses' "
             "length, last 10 | held-out accuracy, start -> end |", "|---|---|---|---|---|---|"]
    growth = {}
    for name, group in runs.items():
        first = [window(r, key, True) for r in group]
        last = [window(r, key, False) for r in group]
        growth[name] = [b - a for a, b in zip(first, last)]
        correct = [window(r, "response_length/correct_mean", False) for r in group]
        acc = [series(r, "val/accuracy")[1] for r in group]
        table.append(f"| {name} | {spread(first, '.2f')} | {spread(last, '.2f')} | {spread(growth[name], '+.2f')} | "
                     f"{spread(correct, '.2f')} | {statistics.fmean(a[0] for a in acc):.1%} -> "
                     f"{spread([a[-1] for a in acc], '.1%')} |")
    grpo, dr = growth["GRPO (per-response mean)"], growth["Dr. GRPO"]
    cut = statistics.fmean(v for group in runs.values() for r in group for v in series(r, "response_length/clip_ratio")[1])
    holds = statistics.fmean(grpo) > 0.5 and statistics.fmean(dr) < statistics.fmean(grpo) and min(grpo) > max(dr)
    verdict = (f"**{'Reproduces' if holds else 'Does not reproduce'} at this scale**: over {args.steps} steps the "
               f"incorrect responses' mean length changed by {spread(grpo, '+.2f')} tokens with GRPO's per-response "
               f"mean and by {spread(dr, '+.2f')} with Dr. GRPO (last 10 steps against the first 10; mean (range) over "
               f"seeds {', '.join(map(str, SEEDS))})"
               + ("." if holds else
                  f". Why, as measured: the responses never press against the budget ({cut:.2%} of them cut off at 16 "
                  f"tokens, over all runs and steps): a countdown answer is a short expression the model ends itself, "
                  f"and both arms shorten wrong answers a little as they learn. The paper's bias needs responses whose "
                  f"length the policy can grow at no cost to being right (reasoning text); these have none."))
    figure = FIGURES / "claim_dr_grpo_length.png"
    plot_curves(runs, [key, "response_length/correct_mean", "val/accuracy"], figure,
                smooth={key: 5, "response_length/correct_mean": 5},
                titles={key: "incorrect responses' length (5-step mean)",
                        "response_length/correct_mean": "correct responses' length (5-step mean)",
                        "val/accuracy": "held-out accuracy (greedy)"})
    publish(SECTION, "dr_grpo_length.py", args, intro=(
        f"Countdown, 64 prompts x 4 samples a step, response budget 16 tokens (the longest solution is 7), "
        f"{args.steps} steps."), table=table, figure=figure, caption="response lengths and accuracy over training",
        verdict=verdict, before=before, after=after)


if __name__ == "__main__":
    main()
