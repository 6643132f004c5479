import math

import pytest
import torch

from rlframe.algos.registry import get_advantage_estimator


def _valid_positions(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def _whiten_reference(per_token, mask, eps):
    """per_token: {(i, t): value} for the valid tokens; whitened with the unbiased variance."""
    vals = list(per_token.values())
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1)
    return {k: (v - mean) / math.sqrt(var + eps) for k, v in per_token.items()}


def reference_gae(rewards, values, mask, gamma, lam, eps):
    """Textbook GAE on each response's list of valid tokens, then batch whitening."""
    adv, ret = {}, {}
    for i in range(rewards.shape[0]):
        pos = _valid_positions(mask, i)
        last = 0.0
        for k in reversed(range(len(pos))):
            next_v = float(values[i, pos[k + 1]]) if k + 1 < len(pos) else 0.0
            delta = float(rewards[i, pos[k]]) + gamma * next_v - float(values[i, pos[k]])
            last = delta + gamma * lam * last
            adv[(i, pos[k])] = last
            ret[(i, pos[k])] = last + float(values[i, pos[k]])
    return _whiten_reference(adv, mask, eps), ret


def reference_returns(rewards, mask, gamma):
    ret = {}
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(_valid_positions(mask, i)):
            running = float(rewards[i, t]) + gamma * running
            ret[(i, t)] = running
    return ret


def _assert_matches(tensor, expected: dict):
    B, R = tensor.shape
    for i in range(B):
        for t in range(R):
            assert tensor[i, t].item() == pytest.approx(expected.get((i, t), 0.0), rel=1e-9, abs=1e-9), (i, t)


def _random_holes(mask, seed):
    """Drop a few tokens inside responses too (e.g. tool-output tokens in multi-turn rollouts)."""
    g = torch.Generator().manual_seed(seed)
    return mask * (torch.rand(mask.shape, generator=g) > 0.2).long()


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference(token_batch, gamma, lam, holes):
    rewards, mask, _ = token_batch(B=10, R=7, seed=4)
    rewards = rewards.double()
    if holes:
        mask = _random_holes(mask, seed=5)
    values = torch.randn(10, 7, dtype=torch.float64)
    adv, ret = get_advantage_estimator("gae")(token_level_rewards=rewards, response_mask=mask, values=values,
                                              gamma=gamma, lam=lam, epsilon=1e-8)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam, 1e-8)
    _assert_matches(adv, ref_adv)
    _assert_matches(ret, ref_ret)


def test_gae_with_gamma_lam_one_returns_monte_carlo_returns(token_batch):
    rewards, mask, _ = token_batch(B=6, R=5, seed=6)
    values = torch.randn(6, 5)
    _, ret = get_advantage_estimator("gae")(token_level_rewards=rewards, response_mask=mask, values=values)
    expected = (rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    assert torch.allclose(ret, expected, atol=1e-6)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(token_batch, gamma):
    rewards, mask, _ = token_batch(B=10, R=6, seed=7)
    rewards = rewards.double()
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(token_level_rewards=rewards, response_mask=mask,
                                                              gamma=gamma, epsilon=1e-8)
    ref_ret = reference_returns(rewards, mask, gamma)
    _assert_matches(ret, ref_ret)
    _assert_matches(adv, _whiten_reference(ref_ret, mask, 1e-8))


def test_remax_matches_reference(token_batch):
    rewards, mask, _ = token_batch(B=8, R=5, seed=8)
    rewards = rewards.double()
    baseline = torch.randn(8, dtype=torch.float64)
    adv, ret = get_advantage_estimator("remax")(token_level_rewards=rewards, response_mask=mask,
                                                baseline_rewards=baseline)
    ref_ret = reference_returns(rewards, mask, 1.0)
    _assert_matches(ret, ref_ret)
    _assert_matches(adv, {k: v - float(baseline[k[0]]) for k, v in ref_ret.items()})


def test_length_one_and_all_masked_rows(token_batch):
    rewards, mask, _ = token_batch(B=4, R=3, seed=9)  # row 0 all-masked, row 1 length 1
    values = torch.randn(4, 3)
    adv, ret = get_advantage_estimator("gae")(token_level_rewards=rewards, response_mask=mask, values=values,
                                              gamma=0.9, lam=0.8)
    assert adv[0].abs().sum() == 0 and ret[0].abs().sum() == 0
    assert ret[1, 0].item() == pytest.approx(rewards[1, 0].item())  # terminal: no bootstrap
    assert torch.isfinite(adv).all()


def test_missing_inputs_are_clear_errors():
    rewards, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="'gae' needs values"):
        get_advantage_estimator("gae")(token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="'remax' needs baseline_rewards"):
        get_advantage_estimator("remax")(token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match=r"baseline_rewards must be \(B,\)"):
        get_advantage_estimator("remax")(token_level_rewards=rewards, response_mask=mask,
                                         baseline_rewards=torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"values has shape \(2, 4\) but response_mask has \(2, 3\)"):
        get_advantage_estimator("gae")(token_level_rewards=rewards, response_mask=mask, values=torch.zeros(2, 4))
