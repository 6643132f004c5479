"""Rewards: rule-based verifiers, reward-function loading, the RewardManager, reward-model helpers."""

from rlframe.rewards.manager import RewardManager, RewardResult, token_level_scores
from rlframe.rewards.registry import RewardFnSpec, default_compute_score, load_reward_fn

__all__ = [
    "RewardFnSpec",
    "RewardManager",
    "RewardResult",
    "default_compute_score",
    "load_reward_fn",
    "token_level_scores",
]
