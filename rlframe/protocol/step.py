"""The settings of one training step that travel with its batch to the workers, as one typed value.

The driver decides them once per step and attaches them to the batch before the first worker call on
it (`with_step`); a worker reads them with `step_settings(batch)`, which refuses a batch that has none
(a silent default temperature of 1.0 would make every ratio and KL term wrong at any other). They ride
in `meta_info[STEP_KEY]`, so they cross processes with the batch and survive its splits and unions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

STEP_KEY = "step"


@dataclass(frozen=True)
class StepSettings:
    """global_step: the step being trained (seeds the mini-batch shuffle, so a resumed run draws the same).
    temperature: the rollout's sampling temperature, which every log-prob of the sampled tokens uses (old,
        reference and the update's own: logits / T); None for a step that samples nothing (SFT).
    on_policy: the batch was sampled by exactly the weights the (single) update starts from, so the
        update's own log-probs, detached, are the old ones (workers/losses.actor_loss_fn).
    allow_empty_minibatches: an off-policy correction dropped tokens from the actor's mask, so a
        mini-batch left with none is skipped, not an error.
    report_first_minibatch: the workers add their first mini-batch's own metrics (the preflight's checks).
    """

    global_step: int
    temperature: float | None = None
    on_policy: bool = False
    allow_empty_minibatches: bool = False
    report_first_minibatch: bool = False

    def but(self, **changes) -> "StepSettings":
        return replace(self, **changes)


def with_step(batch, settings: StepSettings):
    """`batch` with `settings` attached (in place; returned for chaining)."""
    if not isinstance(settings, StepSettings):
        raise TypeError(f"attach a StepSettings, got {type(settings).__name__}")
    batch.meta_info[STEP_KEY] = settings
    return batch


def step_settings(batch) -> StepSettings:
    """The step's settings the driver attached to `batch` (ValueError when it attached none)."""
    found = batch.meta_info.get(STEP_KEY)
    if not isinstance(found, StepSettings):
        raise ValueError("the batch carries no step settings (meta_info['step'] is "
                         f"{type(found).__name__}): the driver attaches rlframe.protocol.step.StepSettings (the "
                         "global step, the rollout's temperature, ...) before any worker call on a step's batch")
    return found


def log_prob_temperature(batch) -> float:
    """The temperature every log-prob of the batch's sampled tokens is taken at (the rollout's)."""
    temperature = step_settings(batch).temperature
    if temperature is None:
        raise ValueError("the batch's step settings have no temperature: log-probs of sampled tokens are taken at "
                         "the rollout's sampling temperature, which the driver sets in StepSettings(temperature=...)")
    return float(temperature)
