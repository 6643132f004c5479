"""The preflight checks as functions: each holds on a correct batch and fails on the defect it is for."""

import numpy as np
import torch

from rlframe.controller.preflight import checks
from rlframe.controller.preflight.sweep import FACTORS, _pairs, config_for, pairwise_rows, valid
from rlframe.protocol import DataProto


def _batch(responses, lps, uids, adv=None):
    responses = torch.as_tensor(responses)
    mask = torch.ones_like(responses, dtype=torch.float32)
    tensors = {"responses": responses, "response_mask": mask, "rollout_log_probs": torch.as_tensor(lps).float(),
               "attention_mask": torch.ones(len(responses), 3 + responses.shape[1], dtype=torch.long)}
    if adv is not None:
        tensors["advantages"] = torch.as_tensor(adv).float()[:, None] * mask
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(uids, dtype=object)})


def test_duplicates_against_their_chance():
    # unlikely samples (p = e^-6 each) that coincide in every group: shared seeds
    dup = _batch([[5, 6, g] for g in range(8) for _ in range(4)], [[-2.0] * 3] * 32, [g for g in "abcdefgh" for _ in range(4)])
    assert not checks.duplicate_samples(checks.duplicate_counts(dup), temperature=1.0).ok
    # a near-certain answer repeats by chance
    sure = _batch([[5, 6, 7]] * 4, [[-0.01] * 3] * 4, ["a"] * 4)
    assert checks.duplicate_samples(checks.duplicate_counts(sure), temperature=1.0).ok


def test_only_the_rare_channel_sees_duplicates_of_unlikely_samples():
    """In each group a likely answer repeats (by chance) and an unlikely one repeats too (shared seeds):
    all duplicates together are within chance, those of unlikely samples are not."""
    likely, unlikely = [[-0.03] * 3] * 2, [[-2.0] * 3] * 2
    groups = "abcdefgh"
    batch = _batch([row for g in range(8) for row in
                   ([5, 6, 7], [5, 6, 7], [8, 9, g], [8, 9, g])], (likely + unlikely) * 8,
                   [g for g in groups for _ in range(4)])
    counts = checks.duplicate_counts(batch)
    assert counts["seen"] <= counts["expected"]  # the overall channel alone would pass
    assert checks._poisson_tail(int(counts["seen"]), counts["expected"]) >= 1e-3
    assert counts["seen_rare"] == 8 and counts["expected_rare"] < 0.1
    assert not checks.duplicate_samples(counts, temperature=1.0).ok


def test_the_duplicate_line_prints_the_rule_that_decides():
    """Its value is the chance of this many duplicates or more, which must reach 1e-3 (a floor, unlike the
    other checks' limits); the counts seen and expected are its detail."""
    counts = {"seen": 6.0, "expected": 0.46, "seen_rare": 0.0, "expected_rare": 0.01, "groups": 3.0}
    check = checks.duplicate_samples(counts, temperature=2.0)
    tail = checks._poisson_tail(6, 0.46)
    assert not check.ok and check.value == tail < 1e-3 and check.limit == 1e-3
    line = check.line()
    assert line.startswith(f"FAIL step 0 duplicate samples in a group (temperature 2.0): chance {tail:.3g} "
                           "(must be >= 0.001) ")
    assert "6 seen where 0.46 are expected over 3 groups" in line and "limit" not in line
    fine = checks.duplicate_samples({**counts, "seen": 1.0}, temperature=2.0)
    assert fine.ok and fine.line().startswith(
        "ok   step 0 duplicate samples in a group (temperature 2.0): chance 0.369 (must be >= 0.001)")
    # the other checks keep value <= limit
    assert checks.reward_repeats(torch.zeros(2), torch.zeros(2)).line().startswith(
        "ok   step 0 reward function repeats its score: 0 (limit 0)")


def test_group_zero_mean_and_estimators():
    good = _batch([[1]] * 4, [[0.0]] * 4, ["a", "a", "b", "b"], adv=[1.0, -1.0, 0.5, -0.5])
    bad = _batch([[1]] * 4, [[0.0]] * 4, ["a", "b", "a", "b"], adv=[1.0, -1.0, 0.5, -0.5])
    assert checks.group_zero_mean(good, estimator="grpo").ok
    assert not checks.group_zero_mean(bad, estimator="rloo").ok
    assert checks.group_zero_mean(bad, estimator="gae") is None  # not a group estimator


def test_logprob_match_and_same_policy():
    mask = torch.ones(2, 3)
    a = torch.full((2, 3), -1.0)
    assert all(c.ok for c in checks.logprob_match(a, a + 1e-5, mask, precision="fp32", what="x", cause=""))
    assert not all(c.ok for c in checks.logprob_match(a, a * 1.1, mask, precision="fp32", what="x", cause=""))
    assert checks.same_policy(a, a, mask, precision="fp32", name="ref", cause="").ok
    # one token far off among many close ones: the mean holds, the max catches it (fp32 and bf16)
    mask = torch.ones(4, 25)
    a = torch.full((4, 25), -1.0)
    for precision, off in (("fp32", 0.1), ("bf16", 0.5)):
        b = a.clone()
        b[2, 7] += off
        mean, worst = checks.logprob_match(a, b, mask, precision=precision, what="x", cause="")
        assert mean.ok and not worst.ok, (precision, mean.line(), worst.line())
    assert not checks.same_policy(a, a - 0.05, mask, precision="bf16", name="ref", cause="").ok


def test_turns_append_only():
    ok = checks.turns_append_only([[[1, 2], [1, 2, 3, 4]]], [[1, 2, 3, 4, 5]])
    broken = checks.turns_append_only([[[1, 2], [1, 9, 3, 4]]], [[1, 9, 3, 4]])
    assert ok.ok and not broken.ok and broken.value == 1


def test_reward_repeats():
    assert checks.reward_repeats(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])).ok
    assert not checks.reward_repeats(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])).ok


def test_sweep_covers_every_valid_pair_with_valid_configs():
    from rlframe.config import load_config, validate

    rows = pairwise_rows()
    assert rows == pairwise_rows()  # fixed: the suite's subset is always the same rows
    names = list(FACTORS)
    everything = [dict(zip(names, levels)) for levels in __import__("itertools").product(*FACTORS.values())]
    wanted = set()
    for r in everything:  # one row's pairs at a time: a union of all ~29,000 sets at once took ~10 s
        if valid(r):
            wanted |= _pairs(r)
    assert wanted <= set().union(*(_pairs(r) for r in rows))
    for row in rows:
        validate(load_config(*config_for(row)))  # the predicates agree with the real validation


def test_nothing_after_end():
    ended = _batch([[5, 2, 0]], [[0.0] * 3], ["a"])
    ended.batch["response_mask"][0, 2] = 0  # padding after the end id 2
    assert checks.nothing_after_end(ended, end_ids=frozenset({2, 3})).ok
    continued = _batch([[5, 3, 7]], [[0.0] * 3], ["a"])  # 3 is an end id too, and 7 was sampled after it
    assert not checks.nothing_after_end(continued, end_ids=frozenset({2, 3})).ok
