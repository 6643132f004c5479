"""Fidelity to the papers where floating point or defaults used to get in the way: groups of equal
rewards, GSPO's sequence-level aggregation, Dr. GRPO's constant normaliser."""

import pytest
import torch

from rlframe.algos import resolve_loss_agg_mode
from rlframe.algos.registry import get_advantage_estimator
from rlframe.config.schema import AlgorithmConfig
from rlframe.workers.losses import actor_loss_fn

GROUP_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "lite_ppo"]


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("reward", [0.7, 0.1, 1.0 / 3.0, 0.0])
def test_equal_rewards_give_exactly_zero_advantage(name, reward):
    # Group "a": eight equal rewards (float32 mean of 0.7 x 8 is off by rounding); group "b" varies.
    B, R = 12, 4
    mask = torch.ones(B, R, dtype=torch.long)
    mask[3, 2:] = 0  # a shorter response in the equal group changes nothing
    scores = torch.tensor([reward] * 8 + [0.0, 1.0, 0.5, 0.25], dtype=torch.float32)
    rewards = torch.zeros(B, R)
    last = mask.sum(-1) - 1
    rewards[torch.arange(B), last] = scores
    index = ["a"] * 8 + ["b"] * 4
    adv, ret = get_advantage_estimator(name)(token_level_rewards=rewards, response_mask=mask, index=index)
    assert torch.equal(adv[:8], torch.zeros(8, R)), adv[:8]
    assert torch.equal(ret[:8], torch.zeros(8, R))
    assert adv[8:].abs().sum() > 0  # the informative group still learns


def test_grpo_float32_rounding_case():
    """The case from the issue: |A| was about 0.056 for eight rewards of 0.7."""
    mask = torch.ones(8, 1)
    adv, _ = get_advantage_estimator("grpo")(token_level_rewards=torch.full((8, 1), 0.7), response_mask=mask,
                                            index=[0] * 8)
    assert torch.count_nonzero(adv) == 0


def _gspo_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, R = 6, 9
    lengths = torch.tensor([1, 3, 9, 5, 2, 7])
    mask = (torch.arange(R)[None] < lengths[:, None]).float()
    old = -torch.rand(B, R, generator=g)
    new = (old + 2e-4 * torch.randn(B, R, generator=g)).requires_grad_()
    adv = torch.randn(B, 1, generator=g).expand(B, R) * mask
    return old, new, adv, mask, lengths


def test_gspo_defaults_to_the_papers_sequence_level_objective():
    assert resolve_loss_agg_mode(policy_loss="gspo", loss_agg_mode=None) == "seq-mean-token-mean"
    assert resolve_loss_agg_mode(policy_loss="ppo", loss_agg_mode=None) == "token-mean"
    assert resolve_loss_agg_mode(policy_loss="gspo", loss_agg_mode="token-mean") == "token-mean"

    old, new, adv, mask, lengths = _gspo_inputs()
    algo = AlgorithmConfig(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    loss, _ = actor_loss_fn(algo)({"log_probs": new}, {"old_log_probs": old, "advantages": adv, "response_mask": mask})
    # Zheng et al. 2025, eq. 5: J = mean_i min(s_i A_i, clip(s_i, 1 - eps_l, 1 + eps_h) A_i),
    # s_i = exp(mean over response i's tokens of (log pi_new - log pi_old)).
    s = torch.exp(((new - old) * mask).sum(-1) / lengths)
    a = adv[:, 0]
    reference = -torch.minimum(s * a, torch.clamp(s, 1 - 3e-4, 1 + 4e-4) * a).mean()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-7)
    (g_loss,) = torch.autograd.grad(loss, new)
    (g_ref,) = torch.autograd.grad(reference, new)
    torch.testing.assert_close(g_loss, g_ref, rtol=1e-5, atol=1e-7)

    explicit = AlgorithmConfig(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="token-mean")
    token_loss, _ = actor_loss_fn(explicit)({"log_probs": new}, {"old_log_probs": old, "advantages": adv,
                                                                 "response_mask": mask})
    assert not torch.allclose(token_loss, loss)  # the override wins (lengths differ, so the weights do)


def test_dr_grpo_norm_divides_by_the_configured_max_length_whatever_the_padding():
    """Two micro-batches of the same responses padded to different lengths give the same loss,
    and that loss is the token sum over the configured maximum response length (12 here)."""
    from rlframe.config import load_config, validate
    from rlframe.controller.trainers.roles import role_specs

    cfg = validate(load_config("grpo_tiny", ["algorithm.name=dr_grpo", "algorithm.adv_estimator=dr_grpo",
                                             "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
                                             "algorithm.use_kl_loss=false", "data.response_length=12"]))
    algo = role_specs(cfg, actor_path="unused", critic_path="unused")["actor"].kwargs["algorithm"]
    assert algo.loss_scale_factor == 12.0

    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([2, 5, 3])
    adv = torch.randn(3, 1, generator=g)
    losses = []
    for R in (5, 8):
        mask = (torch.arange(R)[None] < lengths[:, None]).float()
        old = torch.zeros(3, R)
        loss, _ = actor_loss_fn(algo)({"log_probs": torch.zeros(3, R)},
                                      {"old_log_probs": old, "advantages": adv.expand(3, R) * mask,
                                       "response_mask": mask})
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    expected = (-(adv[:, 0] * lengths) / 12.0).mean()  # ratio 1: each token's loss is -A
    torch.testing.assert_close(losses[0], expected)
