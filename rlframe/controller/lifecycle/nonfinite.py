"""Non-finite values in a run: reported, counted, and fatal when they persist.

The engines already refuse to apply a non-finite gradient (the optimizer step is skipped and
`<role>/skipped` is the fraction of that role's optimizer steps skipped in the training step).
Here, on the driver, every logged step is inspected:

- a non-finite metric is logged as NaN (never dropped), and `train/nonfinite_metrics` counts them;
- a step with a non-finite metric or a skipped optimizer step is a non-finite step:
  `train/nonfinite_steps` counts them over the run, `train/nonfinite_in_a_row` the current streak;
- `trainer.max_nonfinite_steps` non-finite steps in a row stop the run with `NonFiniteTrainingError`
  (after the step's metrics are written), since a run whose updates are all skipped is not training.
"""

from __future__ import annotations

import math

from rlframe.utils.console import say


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps with non-finite losses, gradients or metrics."""


def nonfinite_keys(metrics: dict) -> list[str]:
    return sorted(k for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(float(v)))


class NonFiniteGuard:
    def __init__(self, *, max_in_a_row: int | None):
        self.max_in_a_row = max_in_a_row
        self.total = 0
        self.in_a_row = 0
        self._first_of_streak: int | None = None
        self._last: tuple[int, list[str], dict[str, float]] | None = None

    def observe(self, step: int, metrics: dict) -> dict[str, float]:
        """The counters to log with this step (and a console warning for a non-finite step)."""
        bad = nonfinite_keys(metrics)
        skipped = {k: float(v) for k, v in metrics.items() if k.endswith("/skipped") and v}
        if bad or skipped:
            self.total += 1
            self.in_a_row += 1
            self._first_of_streak = step if self.in_a_row == 1 else self._first_of_streak
            self._last = (step, bad, skipped)
            limit = f"{self.in_a_row} of {self.max_in_a_row} allowed in a row" if self.max_in_a_row else ""
            say(f"step {step}: non-finite values in {bad[:6] or 'none'}; optimizer steps skipped: "
                f"{skipped or 'none'} ({limit})")
        else:
            self.in_a_row = 0
        return {"train/nonfinite_metrics": float(len(bad)), "train/nonfinite_steps": float(self.total),
                "train/nonfinite_in_a_row": float(self.in_a_row)}

    def raise_if_exceeded(self) -> None:
        if self.max_in_a_row is None or self.in_a_row < self.max_in_a_row:
            return
        step, bad, skipped = self._last
        raise NonFiniteTrainingError(
            f"{self.in_a_row} steps in a row (steps {self._first_of_streak}-{step}) had non-finite losses, "
            f"gradients or metrics (last: non-finite {bad[:8]}, skipped optimizer steps {skipped}); the skipped "
            "updates left the weights unchanged, so the run is stopped. Look for the first non-finite metric in "
            "metrics.jsonl; usual causes are a learning rate too high (actor.lr, critic.lr), rewards that are "
            "NaN or huge, or log-probs of tokens the policy cannot produce. trainer.max_nonfinite_steps="
            f"{self.max_in_a_row} sets how many such steps in a row are tolerated"
        )
