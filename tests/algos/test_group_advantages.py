import math

import numpy as np
import pytest
import torch

from rlframe.algos.registry import get_advantage_estimator


def _scores(rewards, mask):
    return [sum(float(rewards[i, t]) for t in range(rewards.shape[1]) if mask[i, t]) for i in range(rewards.shape[0])]


def _members(index):
    groups = {}
    ids = index.tolist() if hasattr(index, "tolist") else list(index)
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    return groups


def _std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def reference_sequence_advantages(name, scores, index, eps):
    """Per-sample advantage, computed group by group with plain Python lists."""
    groups = _members(index)
    adv = [0.0] * len(scores)
    for rows in groups.values():
        s = [scores[i] for i in rows]
        mean = sum(s) / len(s)
        for i in rows:
            if name == "grpo":
                adv[i] = (scores[i] - mean) / (_std(s) + eps)
            elif name == "rloo":
                adv[i] = scores[i] - (sum(s) - scores[i]) / (len(s) - 1)
            elif name in ("dr_grpo", "reinforce_plus_plus_baseline"):
                adv[i] = scores[i] - mean
            elif name == "lite_ppo":
                adv[i] = (scores[i] - mean) / (_std(scores) + eps)
            elif name == "raft":
                adv[i] = 1.0 if scores[i] == max(s) and max(s) > 0 else 0.0
    return adv


def _whiten_tokens(seq_adv, mask, eps):
    toks = {(i, t): seq_adv[i] for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]}
    vals = list(toks.values())
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return {k: (v - mean) / math.sqrt(var + eps) for k, v in toks.items()}


NAMES = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "lite_ppo", "raft"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("index_kind", ["strings", "int-tensor", "shuffled-uneven"])
def test_matches_reference(name, index_kind, token_batch, string_uids):
    rewards, mask, _ = token_batch(B=12, R=6, seed=10)
    rewards = rewards.double()
    if index_kind == "strings":
        index = string_uids(12, 4)
    elif index_kind == "int-tensor":
        index = torch.arange(12) // 3
    else:  # groups interleaved and of sizes 5, 4 and 3
        index = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 0], dtype=object)
    eps = 1e-6
    adv, ret = get_advantage_estimator(name)(token_level_rewards=rewards, response_mask=mask, index=index, epsilon=eps)
    seq_adv = reference_sequence_advantages(name, _scores(rewards, mask), index, eps)
    if name == "reinforce_plus_plus_baseline":
        expected = _whiten_tokens(seq_adv, mask, eps)
    else:
        expected = {(i, t): seq_adv[i] for i in range(12) for t in range(6) if mask[i, t]}
    for i in range(12):
        for t in range(6):
            assert adv[i, t].item() == pytest.approx(expected.get((i, t), 0.0), rel=1e-9, abs=1e-9), (i, t)
    assert torch.equal(adv, ret)
    assert adv[0].abs().sum() == 0  # the all-masked row


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_of_one_is_an_error_where_undefined(name):
    rewards, mask = torch.ones(3, 2), torch.ones(3, 2)
    with pytest.raises(ValueError, match=rf"{name}: group 'solo' has 1 sample\(s\) but needs at least 2"):
        get_advantage_estimator(name)(token_level_rewards=rewards, response_mask=mask,
                                      index=np.array(["pair", "pair", "solo"], dtype=object))


@pytest.mark.parametrize("name", ["dr_grpo", "lite_ppo", "reinforce_plus_plus_baseline"])
def test_group_of_one_gets_zero_advantage_where_defined(name):
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [5.0, 0.0]])
    adv, _ = get_advantage_estimator(name)(token_level_rewards=rewards, response_mask=torch.ones(3, 2),
                                           index=["pair", "pair", "solo"])
    assert torch.allclose(adv[2], torch.zeros(2), atol=1e-6)  # its own mean is its baseline
    assert adv[0, 0] > 0 > adv[1, 0]


def test_raft_keeps_each_groups_best_responses_when_positive():
    # scores per row (one token each): group a [0, 1, 1, 0.5] keeps both 1s; group b [0, 0] keeps none;
    # group c [-1, -0.5] keeps none (its best is not positive); a lone positive sample is kept
    scores = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.0, 0.0, -1.0, -0.5, 0.3]).unsqueeze(-1)
    adv, _ = get_advantage_estimator("raft")(token_level_rewards=scores, response_mask=torch.ones(9, 1),
                                             index=list("aaaabbccd"))
    assert adv.squeeze(-1).tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 1]


def test_identical_rewards_give_zero_grpo_advantages():
    adv, _ = get_advantage_estimator("grpo")(token_level_rewards=torch.ones(4, 3), response_mask=torch.ones(4, 3),
                                             index=[0, 0, 1, 1])
    assert torch.equal(adv, torch.zeros(4, 3))


@pytest.mark.parametrize("name", NAMES)
def test_missing_index_is_a_clear_error(name):
    with pytest.raises(ValueError, match=rf"'{name}' needs index \(B,\)"):
        get_advantage_estimator(name)(token_level_rewards=torch.zeros(2, 2), response_mask=torch.ones(2, 2))
