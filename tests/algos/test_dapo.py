import numpy as np
import pytest
import torch

from rlframe.algos.dapo import (
    DynamicSamplingProgress,
    filter_groups_by_reward_variance,
    first_groups,
    overlong_reward_penalty,
)


def reference_filter(scores, index):
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    kept = [g for g, rows in groups.items() if len({float(scores[i]) for i in rows}) > 1]
    return sorted(i for g in kept for i in groups[g]), kept


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filter_matches_reference_on_random_binary_rewards(seed):
    g = torch.Generator().manual_seed(seed)
    B = 24
    index = np.array([f"p{int(i)}" for i in torch.randint(0, 8, (B,), generator=g)], dtype=object)
    while any((index == u).sum() < 2 for u in set(index)):  # every prompt has at least two samples
        index = np.concatenate([index, np.array([u for u in set(index) if (index == u).sum() < 2], dtype=object)])
    scores = torch.randint(0, 2, (len(index),), generator=g).float()
    result = filter_groups_by_reward_variance(scores=scores, index=index)
    ref_rows, ref_groups = reference_filter(scores, list(index))
    assert result.kept_indices.tolist() == ref_rows
    assert result.kept_group_ids == ref_groups
    assert result.num_groups == len(set(index)) and result.num_kept_groups == len(ref_groups)


def test_filter_tolerance_and_numpy_scores():
    result = filter_groups_by_reward_variance(scores=np.array([1.0, 1.0 + 1e-9, 0.0, 1.0]),
                                              index=[0, 0, 1, 1], atol=1e-6)
    assert result.kept_indices.tolist() == [2, 3] and result.num_dropped_groups == 1


def test_filter_rejects_groups_of_one():
    with pytest.raises(ValueError, match="DAPO dynamic sampling: group 'x' has 1 sample"):
        filter_groups_by_reward_variance(scores=torch.zeros(3), index=["x", "y", "y"])


def test_dynamic_sampling_loop_fills_the_batch_with_whole_groups():
    """Rounds of 4 prompts x 2 samples; keep sampling until 5 informative groups are collected."""
    progress = DynamicSamplingProgress(target_num_groups=5, max_num_gen_batches=10)
    g = torch.Generator().manual_seed(3)
    kept_uids, kept_scores, rounds = [], [], 0
    while True:
        rounds += 1
        uid = np.array([f"r{rounds}-p{i // 2}" for i in range(8)], dtype=object)
        scores = torch.randint(0, 2, (8,), generator=g).float()
        result = filter_groups_by_reward_variance(scores=scores, index=uid)
        kept_uids.extend(uid[result.kept_indices])
        kept_scores.extend(scores[result.kept_indices].tolist())
        if progress.update(result):
            break
    rows = first_groups(np.array(kept_uids, dtype=object), num_groups=5)
    final = [kept_uids[i] for i in rows]
    assert len(set(final)) == 5 and len(final) == 10
    for u in set(final):
        assert len({kept_scores[i] for i in rows if kept_uids[i] == u}) == 2
    assert progress.num_gen_batches == rounds and progress.num_kept_groups >= 5


def test_dynamic_sampling_gives_up_after_max_batches():
    progress = DynamicSamplingProgress(target_num_groups=3, max_num_gen_batches=2)
    nothing = filter_groups_by_reward_variance(scores=torch.ones(4), index=[0, 0, 1, 1])
    assert progress.update(nothing) is False
    with pytest.raises(ValueError, match=r"kept 0 of the 3 groups needed after 2 generation batches"):
        progress.update(nothing)


def reference_overlong(length, l_max, l_cache, factor):
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return factor * ((l_max - l_cache) - length) / l_cache
    return -factor


def test_overlong_penalty_matches_dapo_equation_13():
    lengths = torch.arange(0, 25)
    got = overlong_reward_penalty(response_lengths=lengths, max_response_length=20, overlong_buffer_len=8,
                                  penalty_factor=0.5)
    for n, v in zip(lengths.tolist(), got.tolist()):
        assert v == pytest.approx(reference_overlong(n, 20, 8, 0.5)), n
    assert got[12] == 0 and got[20] == pytest.approx(-0.5)  # the ramp starts at L_max - L_cache, ends at -1
    with pytest.raises(ValueError, match="overlong_buffer_len must be in"):
        overlong_reward_penalty(response_lengths=lengths, max_response_length=20, overlong_buffer_len=0)
