"""KL between the policy and the reference policy: estimators, the penalty in the reward (with a
fixed or adaptive coefficient), and the penalty as a loss term.

Per-token estimators of KL(pi || pi_ref) from samples y_t ~ pi (Schulman 2020, "Approximating KL
divergence", http://joschu.net/blog/kl-approx.html), with log r = log pi(y_t) - log pi_ref(y_t):

| name (aliases) | value | notes |
|---|---|---|
| k1 (kl) | log r | unbiased, high variance, can be negative |
| abs | abs(log r) | |
| k2 (mse) | 0.5 (log r)^2 | biased, low variance; its gradient is the KL's gradient in expectation |
| k3 (low_var_kl) | exp(-log r) - 1 + log r | unbiased and always >= 0 (used by GRPO) |

k3 clamps log r to [-20, 20] before exp and its value to at most 10, as KL-in-loss implementations
do, so one token the reference finds very unlikely cannot dominate a batch.

Where the KL goes:
- in the reward (InstructGPT / Ziegler et al. 2019): `apply_kl_penalty` subtracts
  kl_coef * KL_t from the token-level scores; the coefficient comes from `FixedKLController` or
  `AdaptiveKLController`.
- in the loss (GRPO, REINFORCE++-baseline): `compute_kl_loss` aggregates KL_t like any loss.
"""

from __future__ import annotations

import torch

from rlframe.algos.aggregation import agg_loss
from rlframe.algos.masked import check_token_tensors, masked_mean
from rlframe.algos.registry import get_kl_estimator, register_kl_estimator

_K3_LOG_RATIO_CLAMP = 20.0
_K3_MAX = 10.0


@register_kl_estimator("k1")
@register_kl_estimator("kl")
def kl_k1(*, log_prob, ref_log_prob):
    """log pi - log pi_ref. Shapes (B, R) -> (B, R)."""
    return log_prob - ref_log_prob


@register_kl_estimator("abs")
def kl_abs(*, log_prob, ref_log_prob):
    """|log pi - log pi_ref|. Shapes (B, R) -> (B, R)."""
    return (log_prob - ref_log_prob).abs()


@register_kl_estimator("k2")
@register_kl_estimator("mse")
def kl_k2(*, log_prob, ref_log_prob):
    """0.5 (log pi - log pi_ref)^2. Shapes (B, R) -> (B, R)."""
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_estimator("k3")
@register_kl_estimator("low_var_kl")
def kl_k3(*, log_prob, ref_log_prob):
    """pi_ref / pi - 1 - log(pi_ref / pi), clamped (see module docstring). Shapes (B, R) -> (B, R)."""
    log_ratio = torch.clamp(ref_log_prob - log_prob, -_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_ratio) - 1.0 - log_ratio, max=_K3_MAX)


def kl_penalty(*, log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate (B, R) with the named estimator ("k1", "k2", "k3", "abs", or a registered one)."""
    if tuple(log_prob.shape) != tuple(ref_log_prob.shape):
        raise ValueError(f"log_prob {tuple(log_prob.shape)} and ref_log_prob {tuple(ref_log_prob.shape)} must match")
    return get_kl_estimator(estimator)(log_prob=log_prob, ref_log_prob=ref_log_prob)


@torch.no_grad()
def apply_kl_penalty(
    *,
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward (Ziegler et al. 2019, arXiv:1909.08593; Ouyang et al. 2022):
    r_t = score_t - kl_coef * KL_t on the valid tokens.

    Args:
        token_level_scores (B, R): rewards (the outcome score on the last response token).
        old_log_prob, ref_log_prob (B, R): log-probs of the sampled tokens under the rollout
            policy and the reference policy.
        response_mask (B, R); kl_coef: the controller's current value; estimator: a KL estimator name.
    Returns:
        token_level_rewards (B, R), zero off the mask, and metrics (python floats):
        "actor/reward_kl_penalty", the batch mean of each sequence's mean KL (what
        `AdaptiveKLController.update` takes as current_kl), and "actor/reward_kl_penalty_coeff".
    """
    check_token_tensors(response_mask=response_mask, token_level_scores=token_level_scores,
                        old_log_prob=old_log_prob, ref_log_prob=ref_log_prob)
    kld = kl_penalty(log_prob=old_log_prob, ref_log_prob=ref_log_prob, estimator=estimator)
    valid = response_mask.to(torch.bool)
    rewards = torch.where(valid, token_level_scores - kl_coef * kld, torch.zeros_like(token_level_scores))
    seq_kl = masked_mean(kld, response_mask, dim=-1)
    nonempty = valid.any(dim=-1)
    current_kl = seq_kl[nonempty].mean().item() if nonempty.any() else 0.0
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(kl_coef)}


def compute_kl_loss(
    *,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    loss_agg_mode: str = "token-mean",
    global_token_count: int | float | None = None,
    global_seq_count: int | float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """KL in the loss (GRPO, Shao et al. 2024, arXiv:2402.03300, eq. 3-4): the aggregated per-token
    estimate, to be added to the policy loss times a coefficient. Gradient flows through log_prob.
    Shapes (B, R) -> scalar.
    """
    check_token_tensors(response_mask=response_mask, log_prob=log_prob, ref_log_prob=ref_log_prob)
    kld = kl_penalty(log_prob=log_prob, ref_log_prob=ref_log_prob.detach(), estimator=estimator)
    return agg_loss(loss_mat=kld, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                    global_token_count=global_token_count, global_seq_count=global_seq_count,
                    loss_scale_factor=loss_scale_factor)


class FixedKLController:
    """A constant KL coefficient. `update` exists so trainers treat both controllers alike."""

    def __init__(self, *, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, *, current_kl: float, n_steps: int) -> None:
        """No change."""

    def state_dict(self) -> dict:
        return {"kind": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: a fixed coefficient is a setting, not state, so the value this
        controller was made with (the config's, on a resume) stays, whatever the checkpoint held."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
    Preferences", arXiv:1909.08593, Sec. 2.2): a proportional controller steering KL to a target.

    e = clip(KL / target_kl - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon)
    where n_steps is the number of samples (or steps, consistently) since the last update.
    """

    def __init__(self, *, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 (the KL the controller steers to), got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 (samples over which beta may change by 20%), got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, *, current_kl: float, n_steps: int) -> None:
        """Move the coefficient toward keeping `current_kl` at `target_kl`."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"kind": "adaptive", "value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        """Continue from the saved coefficient when it steered to the same target (a checkpoint of an
        older version, without a target, counts as the same); a changed target, or a saved fixed
        controller, restarts from the initial coefficient this controller was made with. The horizon
        is a setting: this controller's applies."""
        if state.get("kind", "adaptive") != "adaptive":
            return
        if "target_kl" in state and float(state["target_kl"]) != self.target_kl:
            return
        self.value = float(state["value"])


def make_kl_controller(*, kind: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None):
    """The controller a config names: kind "fixed" (kl_coef) or "adaptive" (kl_coef is the initial
    value; target_kl and horizon are required)."""
    if kind == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                f"an adaptive KL controller needs target_kl and horizon (got target_kl={target_kl}, "
                f"horizon={horizon}); set both, or use kind='fixed'"
            )
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown KL controller kind {kind!r}; known: ['adaptive', 'fixed']")
