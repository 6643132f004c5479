"""Claim (Dong et al. 2023, "RAFT: Reward rAnked FineTuning for Generative Foundation Model
Alignment", arXiv:2304.06767; rejection sampling as in Liu et al. 2023, RSO, arXiv:2309.06657):
fine-tuning on the best of k sampled responses reaches PPO's reward on the same generation budget,
with no critic and no importance ratio.

    python benchmarks/claims/raft.py [--steps 40] [--no-write]

The demo task, 128 generated responses a step in both arms: PPO as shipped (128 prompts x 1, a
critic, GAE) against RAFT (`algorithm=raft`: 32 prompts x 4, each group's best responses, when
correct, trained on with advantage 1, the rest 0; one optimizer step per batch), three seeds.
Reported: held-out greedy accuracy over training and after --steps steps, the training batches'
accuracy, and the share of response tokens RAFT trained on. The verdict's words on the mean over
seeds: RAFT "passes" PPO above PPO's best seed, "matches" it within PPO's range of seeds, "falls
short" below PPO's worst seed.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline import job  # noqa: E402
from common import (FIGURES, SEEDS, at_step, claim_args, machine_state, plot_curves, publish, run_job, series,  # noqa: E402
                    spread)

SECTION = "## RAFT (rejection sampling) reaches PPO on the same generation budget"
RAFT = ["algorithm=raft", "data.train_batch_size=32", "actor.mini_batch_size=128"]


def kept_share(rows: list[dict]) -> float:
    """Mean over steps of the share of response tokens with advantage 1 (critic/advantages/mean: the mean over
    valid tokens of advantages that are 1 or 0)."""
    return statistics.fmean(series(rows, "critic/advantages/mean")[1])


def main() -> None:
    args = claim_args(__doc__, steps=40)
    before = machine_state()
    runs = {"PPO (128 x 1)": [], "RAFT (32 x 4)": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in SEEDS:
            runs["PPO (128 x 1)"].append(job("ppo", "addition", args.steps, seed, Path(tmp)))
            runs["RAFT (32 x 4)"].append(run_job([*RAFT, f"trainer.total_steps={args.steps}", "trainer.val_every=10"],
                                                 seed=seed, out=Path(tmp), name="raft_budget", config="ppo_tiny"))
    after = machine_state()
    final = {n: [at_step(r, "val/accuracy", args.steps) for r in g] for n, g in runs.items()}
    reward = {n: [statistics.fmean(series(r, "critic/accuracy")[1][-10:]) for r in g] for n, g in runs.items()}
    table = ["| arm | held-out accuracy, start -> after training | training accuracy, last 10 steps | s per step |",
             "|---|---|---|---|"]
    for name, group in runs.items():
        start = statistics.fmean(series(r, "val/accuracy")[1][0] for r in group)
        step_s = [statistics.median(series(r, "timing_s/step")[1]) for r in group]
        table.append(f"| {name} | {start:.1%} -> {spread(final[name], '.1%')} | {spread(reward[name], '.1%')} | "
                     f"{spread(step_s, '.2f')} |")
    ppo, raft = final["PPO (128 x 1)"], final["RAFT (32 x 4)"]
    mean = statistics.fmean(raft)
    word = "passes" if mean > max(ppo) else "matches (within PPO's range of seeds)" if mean >= min(ppo) else "falls short of"
    kept = [kept_share(r) for r in runs["RAFT (32 x 4)"]]
    verdict = (f"**{'Reproduces' if word != 'falls short of' else 'Does not reproduce'} at this scale**: RAFT {word} "
               f"PPO's held-out accuracy on the same 128 responses a step ({spread(raft, '.1%')} against "
               f"{spread(ppo, '.1%')} after {args.steps} steps, {100 * (mean - statistics.fmean(ppo)):+.1f} points; "
               f"mean (range) over seeds {', '.join(map(str, SEEDS))}), "
               f"training on {spread(kept, '.1%')} of the response tokens it generated (its groups' correct responses).")
    figure = FIGURES / "claim_raft.png"
    plot_curves(runs, ["val/accuracy", "critic/accuracy"], figure, smooth={"critic/accuracy": 5},
                titles={"val/accuracy": "held-out accuracy (greedy)",
                        "critic/accuracy": "training batch accuracy (5-step mean)"})
    publish(SECTION, "raft.py", args, intro=f"The demo task, 128 responses a step in both arms, {args.steps} steps.",
            table=table, figure=figure, caption="accuracy over training", verdict=verdict, before=before, after=after)


if __name__ == "__main__":
    main()
