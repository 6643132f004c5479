"""Advantage estimators built on returns-to-go: GAE (with a critic), REINFORCE++ and ReMax.

Every estimator, here and in `group_advantages.py`, has the same keyword-only signature so the
trainer can call any of them by the name in its config (`get_advantage_estimator(name)`):

    fn(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
       gamma=1.0, lam=1.0, epsilon=1e-6) -> (advantages, returns)

    token_level_rewards (B, R) float: per-token rewards (outcome reward on the last response
                                      token, minus the KL penalty when KL is in the reward).
    response_mask       (B, R) 0/1:   tokens that count.
    index               (B,):         group id of each sample (`uid`), for group estimators.
    values              (B, R) float: critic values, for GAE.
    baseline_rewards    (B,) float:   reward of the greedy response to the same prompt, for ReMax.
    advantages, returns (B, R) float: zero off the mask; computed without gradient.

Inputs an estimator does not use are ignored; a missing input it needs is a ValueError.
Masked-out tokens are skipped, not treated as zero-reward steps: a response is the sequence of its
valid tokens, so the step after the last valid token is terminal (value 0).
"""

from __future__ import annotations

import torch

from rlframe.algos.masked import (
    as_float_mask,
    check_token_tensors,
    masked_whiten,
    reverse_discounted_cumsum,
)
from rlframe.algos.registry import register_advantage_estimator


def _require(value, *, name: str, estimator: str, hint: str):
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {name}, which is missing; {hint}")
    return value


@register_advantage_estimator("gae", needs_critic=True)
@torch.no_grad()
def gae(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
        gamma=1.0, lam=1.0, epsilon=1e-6):
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438), token-level.

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = sum_l (gamma * lam)^l delta_{t+l},
    over the valid tokens of each response, with V = 0 after the last one.
    returns = A + V (the critic's regression target, unwhitened); the advantages are then whitened
    over all valid tokens of the batch, as PPO implementations do (Huang et al. 2022, "The 37
    implementation details of PPO"; `epsilon` guards the variance).

    Needs: values (B, R). Shapes: all (B, R).
    """
    values = _require(values, name="values (B, R) from the critic", estimator="gae",
                      hint="run critic.compute_values before computing advantages, or use a critic-free estimator")
    check_token_tensors(response_mask=response_mask, token_level_rewards=token_level_rewards, values=values)
    valid = as_float_mask(response_mask, token_level_rewards).bool()
    advantages = torch.zeros_like(token_level_rewards)
    next_value = torch.zeros_like(token_level_rewards[:, 0])
    last_gae = torch.zeros_like(next_value)
    for t in reversed(range(token_level_rewards.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        step_gae = delta + gamma * lam * last_gae
        # Masked positions leave the carry untouched, so the recursion jumps over them.
        last_gae = torch.where(valid[:, t], step_gae, last_gae)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(valid[:, t], step_gae, torch.zeros_like(step_gae))
    returns = torch.where(valid, advantages + values, torch.zeros_like(values))
    return masked_whiten(advantages, response_mask, epsilon=epsilon), returns


@register_advantage_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
                        gamma=1.0, lam=1.0, epsilon=1e-6):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go, whitened over the batch.

    returns_t = sum_{l>=0} gamma^l r_{t+l} over the valid tokens (the token-level KL penalty is part
    of r, i.e. use it with KL in the reward); advantages = (returns - mean) / sqrt(var + epsilon)
    with mean and var over every valid token of the batch ("global batch normalization").

    Needs: nothing beyond the rewards. Shapes: all (B, R).
    """
    check_token_tensors(response_mask=response_mask, token_level_rewards=token_level_rewards)
    returns = reverse_discounted_cumsum(token_level_rewards, response_mask, gamma=gamma)
    return masked_whiten(returns, response_mask, epsilon=epsilon), returns


@register_advantage_estimator("remax", extra_rollout="greedy")
@torch.no_grad()
def remax(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
          gamma=1.0, lam=1.0, epsilon=1e-6):
    """ReMax (Li et al. 2023, arXiv:2310.10505): REINFORCE with the greedy response's reward as baseline.

    returns_t = discounted return-to-go of the sampled response (gamma = 1 in the paper);
    advantages_t = returns_t - b, where b is the reward of the greedy (argmax) response to the
    same prompt, generated by one extra rollout per prompt.

    Needs: baseline_rewards (B,). Shapes: rewards/mask (B, R), baseline_rewards (B,).
    """
    baseline_rewards = _require(
        baseline_rewards, name="baseline_rewards (B,), the reward of the greedy response to each prompt",
        estimator="remax", hint="generate one greedy response per prompt and score it (the ReMax dataflow)",
    )
    check_token_tensors(response_mask=response_mask, token_level_rewards=token_level_rewards)
    if tuple(baseline_rewards.shape) != (token_level_rewards.shape[0],):
        raise ValueError(
            f"baseline_rewards must be (B,) = ({token_level_rewards.shape[0]},), got {tuple(baseline_rewards.shape)}"
        )
    returns = reverse_discounted_cumsum(token_level_rewards, response_mask, gamma=gamma)
    baseline = baseline_rewards.to(returns).unsqueeze(-1)
    advantages = torch.where(as_float_mask(response_mask, returns).bool(), returns - baseline, torch.zeros_like(returns))
    return advantages, returns
