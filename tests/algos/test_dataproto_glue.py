import numpy as np
import pytest
import torch

from rlframe.algos import (
    AdaptiveKLController,
    apply_kl_penalty,
    apply_kl_penalty_to_batch,
    compute_advantage,
    get_advantage_estimator,
)
from rlframe.protocol import DataProto


def _batch(token_batch, string_uids, **extra):
    scores, mask, _ = token_batch(B=8, R=5, seed=20)
    g = torch.Generator().manual_seed(20)
    tensors = {
        "token_level_scores": scores,
        "response_mask": mask,
        "old_log_probs": -torch.rand(8, 5, generator=g),
        "ref_log_prob": -torch.rand(8, 5, generator=g),
        "values": torch.randn(8, 5, generator=g),
        **extra,
    }
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": string_uids(8, 4)})


def test_ppo_step_kl_in_reward_then_gae(token_batch, string_uids):
    data = _batch(token_batch, string_uids)
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.01, horizon=100)
    metrics = apply_kl_penalty_to_batch(data, kl_ctrl=ctrl, estimator="k1")
    expected_rewards, expected_metrics = apply_kl_penalty(
        token_level_scores=data.batch["token_level_scores"], old_log_prob=data.batch["old_log_probs"],
        ref_log_prob=data.batch["ref_log_prob"], response_mask=data.batch["response_mask"], kl_coef=0.1)
    assert torch.equal(data.batch["token_level_rewards"], expected_rewards) and metrics == expected_metrics
    assert ctrl.value != 0.1  # the controller saw the measured KL
    out = compute_advantage(data, estimator="gae", gamma=0.99, lam=0.95)
    adv, ret = get_advantage_estimator("gae")(token_level_rewards=expected_rewards,
                                              response_mask=data.batch["response_mask"],
                                              values=data.batch["values"], gamma=0.99, lam=0.95)
    assert out is data and torch.equal(data.batch["advantages"], adv) and torch.equal(data.batch["returns"], ret)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "remax"])
def test_group_and_baseline_estimators_read_uid_and_reward_baselines(token_batch, string_uids, estimator):
    data = _batch(token_batch, string_uids, reward_baselines=torch.linspace(-1, 1, 8))
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    compute_advantage(data, estimator=estimator)
    adv, _ = get_advantage_estimator(estimator)(
        token_level_rewards=data.batch["token_level_scores"], response_mask=data.batch["response_mask"],
        index=np.array(data.non_tensor_batch["uid"]), baseline_rewards=data.batch["reward_baselines"])
    assert torch.equal(data.batch["advantages"], adv)


def test_missing_keys_are_clear_errors(token_batch, string_uids):
    data = _batch(token_batch, string_uids)
    with pytest.raises(ValueError, match="no 'token_level_rewards'.*token_level_scores"):
        compute_advantage(data, estimator="grpo")
    data = DataProto.from_dict(tensors={"token_level_scores": torch.zeros(2, 3), "response_mask": torch.ones(2, 3)})
    with pytest.raises(ValueError, match=r"lacks \['old_log_probs', 'ref_log_prob'\]"):
        apply_kl_penalty_to_batch(data, kl_ctrl=AdaptiveKLController(init_kl_coef=0.1, target_kl=1, horizon=1))
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    with pytest.raises(ValueError, match="'grpo' needs index"):
        compute_advantage(data, estimator="grpo")
