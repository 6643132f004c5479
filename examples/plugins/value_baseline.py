"""A new advantage estimator that needs a critic, in one file: REINFORCE with a learned value baseline.

    A_t = G_t - V(s_t),   G_t = sum_{k >= t} gamma^(k - t) r_k   (the return-to-go of the response)

Monte-Carlo returns with the critic's value as a variance-reducing baseline (Williams 1992; Sutton &
Barto 2018, sec. 13.4): unlike GAE it does not bootstrap from later values, so it is unbiased
whatever the critic knows, at the price of more variance; the critic still learns V towards G_t.
`needs_critic=True` is all the rest of rlframe needs to know: validation, the planner, the memory
estimate and the trainer then give the run a critic.

Run it (one config line; the module is imported in the driver and every worker process):

    python -m rlframe.main imports=[examples.plugins.value_baseline] \
        algorithm.name=reinforce_value_baseline algorithm.adv_estimator=reinforce_value_baseline
"""

from __future__ import annotations

import torch

from rlframe.algos import register_advantage_estimator
from rlframe.config.algorithms import AlgorithmSpec, register_algorithm


@register_advantage_estimator("reinforce_value_baseline", needs_critic=True)
def reinforce_value_baseline(*, token_level_rewards, response_mask, index=None, values=None,
                             baseline_rewards=None, gamma=1.0, lam=1.0, epsilon=1e-6):
    """(B, R) tensors in; (advantages, returns) (B, R) out, zero outside the response."""
    if values is None:
        raise ValueError("reinforce_value_baseline subtracts the critic's values: the batch has none "
                         "(its registration says needs_critic=True, so a run with it has a critic)")
    mask = response_mask.float()
    rewards = token_level_rewards.float() * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):  # G_t = r_t + gamma G_{t+1}
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    returns = returns * mask
    return (returns - values.float()) * mask, returns


# its algorithm name: the PPO family's dataflow with this estimator (`algorithm.name` and the estimator agree)
register_algorithm(AlgorithmSpec("reinforce_value_baseline", {"adv_estimator": ("reinforce_value_baseline",)}))
