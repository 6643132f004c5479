"""The DataProto side of the algorithms: read the batch keys of docs/contracts.md, call the pure
functions, write the results back. The driver calls these between worker-group phases:

    metrics = apply_kl_penalty_to_batch(batch, kl_ctrl=kl_ctrl, estimator="k1")  # KL in the reward
    batch = compute_advantage(batch, estimator="gae", gamma=1.0, lam=0.95)

Keys read: `token_level_scores` / `token_level_rewards`, `response_mask`, `old_log_probs`,
`ref_log_prob`, `values` (GAE), `reward_baselines` (B,) (ReMax: the greedy response's reward), and
the non-tensor `uid` (group estimators). Keys written: `token_level_rewards`, `advantages`, `returns`.
"""

from __future__ import annotations

from typing import Any

from rlframe.algos.kl import apply_kl_penalty
from rlframe.algos.registry import get_advantage_estimator


def _tensor(data, key: str):
    return data.batch[key] if data.batch is not None and key in data.batch.keys() else None


def compute_advantage(data: Any, *, estimator: str, gamma: float = 1.0, lam: float = 1.0,
                      epsilon: float = 1e-6) -> Any:
    """Write `advantages` and `returns` (B, R) into `data.batch` with the named estimator; returns data.

    `token_level_rewards` must be present: it is `apply_kl_penalty_to_batch`'s output, or a copy of
    `token_level_scores` when the KL is not in the reward.
    """
    fn = get_advantage_estimator(estimator)
    rewards = _tensor(data, "token_level_rewards")
    if rewards is None:
        raise ValueError(
            f"compute_advantage({estimator!r}): the batch has no 'token_level_rewards' (tensor keys: "
            f"{data.batch_keys}); call apply_kl_penalty_to_batch first, or, with no KL in the reward, "
            f"set batch['token_level_rewards'] = batch['token_level_scores']"
        )
    mask = _tensor(data, "response_mask")
    if mask is None:
        raise ValueError(f"compute_advantage({estimator!r}): the batch has no 'response_mask' (B, R)")
    uid = data.non_tensor_batch.get("uid")
    advantages, returns = fn(
        token_level_rewards=rewards, response_mask=mask, index=uid,
        values=_tensor(data, "values"), baseline_rewards=_tensor(data, "reward_baselines"),
        gamma=gamma, lam=lam, epsilon=epsilon,
    )
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data


def apply_kl_penalty_to_batch(data: Any, *, kl_ctrl: Any, estimator: str = "k1") -> dict[str, float]:
    """KL in the reward: write `token_level_rewards` = scores - kl_ctrl.value * KL, then update the
    controller with the measured KL and the batch size as n_steps (Ziegler et al. 2019 count
    samples). Reads `token_level_scores`, `old_log_probs`, `ref_log_prob`, `response_mask`.
    Returns the metrics of `apply_kl_penalty`.
    """
    missing = [k for k in ("token_level_scores", "old_log_probs", "ref_log_prob", "response_mask")
               if _tensor(data, k) is None]
    if missing:
        raise ValueError(
            f"apply_kl_penalty_to_batch: the batch lacks {missing} (tensor keys: {data.batch_keys}); "
            f"run the reward, actor.compute_log_prob and ref.compute_ref_log_prob phases first"
        )
    rewards, metrics = apply_kl_penalty(
        token_level_scores=data.batch["token_level_scores"], old_log_prob=data.batch["old_log_probs"],
        ref_log_prob=data.batch["ref_log_prob"], response_mask=data.batch["response_mask"],
        kl_coef=kl_ctrl.value, estimator=estimator,
    )
    data.batch["token_level_rewards"] = rewards
    kl_ctrl.update(current_kl=metrics["actor/reward_kl_penalty"], n_steps=len(data))
    return metrics
