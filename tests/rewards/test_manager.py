import logging

import numpy as np
import pytest
import torch

from rlframe.rewards.manager import RewardManager, token_level_scores
from rlframe.rewards.registry import RewardFnSpec

FLAKY = """
import math
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise RuntimeError("boom on purpose")
    if solution_str == "nan":
        return math.nan
    if solution_str == "inf":
        return {"score": math.inf}
    if solution_str == "str":
        return "1.0"
    return {"score": float(solution_str == ground_truth), "len": len(solution_str)}
"""


@pytest.fixture
def flaky_spec(tmp_path):
    f = tmp_path / "flaky.py"
    f.write_text(FLAKY)
    return RewardFnSpec(path=str(f), name="compute_score")


def _inputs():
    responses = ["7", "raise", "8", "nan", "9", "inf", "str", "9"]
    truths = ["7", "x", "7", "x", "9", "x", "x", "1"]
    return responses, truths, [1, 0, 0, 0, 1, 0, 0, 0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_errors_score_zero_and_are_counted(flaky_spec, caplog, num_workers):
    responses, truths, expected = _inputs()
    with caplog.at_level(logging.WARNING, logger="rlframe.rewards"):
        with RewardManager(fn_spec=flaky_spec, num_workers=num_workers, max_logged_errors=2) as mgr:
            res = mgr.compute(responses, data_sources=["t"] * 8, ground_truths=truths)
            again = mgr.compute(["raise"], data_sources=["t"], ground_truths=["x"])
    np.testing.assert_array_equal(res.scores, np.array(expected, dtype=np.float32))
    assert res.metrics["reward/errors"] == 4.0
    assert res.metrics["reward/mean"] == pytest.approx(2 / 8)
    # extras only from samples that returned them; absent ones are NaN
    assert res.extras["len"][0] == 1.0 and np.isnan(res.extras["len"][1])
    assert again.metrics["reward/errors"] == 1.0
    logged = [r for r in caplog.records if "reward function failed" in r.getMessage()]
    assert len(logged) == 2  # only the first max_logged_errors tracebacks over the lifetime
    assert "boom on purpose" in logged[0].getMessage()


def test_pool_matches_inline_on_builtin_rewards():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 100, 50), rng.integers(0, 100, 50)
    truths = [str(x + y) for x, y in zip(a, b)]
    responses = [t if i % 3 else str(int(t) + 1) for i, t in enumerate(truths)]
    with RewardManager(num_workers=0) as inline, RewardManager(num_workers=2) as pooled:
        r0 = inline.compute(responses, data_sources=["arithmetic"] * 50, ground_truths=truths)
        r1 = pooled.compute(responses, data_sources=["arithmetic"] * 50, ground_truths=truths)
    reference = np.array([float(r == t) for r, t in zip(responses, truths)], dtype=np.float32)
    np.testing.assert_array_equal(r0.scores, reference)
    np.testing.assert_array_equal(r1.scores, reference)
    assert r1.metrics["reward/errors"] == 0.0


def test_hanging_worker_times_out_and_pool_recovers(tmp_path):
    f = tmp_path / "slow.py"
    f.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'hang':\n        time.sleep(60)\n"
        "    return 1.0\n"
    )
    with RewardManager(fn_spec=RewardFnSpec(path=str(f)), num_workers=1, timeout_s=5) as mgr:
        res = mgr.compute(["hang"], data_sources=["t"], ground_truths=["x"])
        assert res.scores.tolist() == [0.0] and res.metrics["reward/errors"] == 1.0
        ok = mgr.compute(["a", "b"], data_sources=["t"] * 2, ground_truths=["x"] * 2)
    assert ok.scores.tolist() == [1.0, 1.0] and ok.metrics["reward/errors"] == 0.0


def test_input_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one entry per response"):
        RewardManager().compute(["a", "b"], data_sources=["arithmetic"], ground_truths=["a", "b"])


def test_bad_spec_fails_at_construction(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        RewardManager(fn_spec=RewardFnSpec(path=str(tmp_path / "nope.py")))


def test_token_level_scores_on_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    scores = np.array([0.5, 1.0, -2.0, 3.0], dtype=np.float32)
    out = token_level_scores(scores, mask)
    ref = torch.zeros(4, 4)
    for i in range(4):
        valid = mask[i].nonzero()
        if len(valid):
            ref[i, valid[-1]] = float(scores[i])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        token_level_scores(np.zeros(3), mask)


def test_dying_worker_is_counted_and_pool_recovers(tmp_path):
    f = tmp_path / "die.py"
    f.write_text(
        "import os\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'die':\n        os._exit(3)\n"
        "    return 0.5\n"
    )
    with RewardManager(fn_spec=RewardFnSpec(path=str(f)), num_workers=1, timeout_s=30) as mgr:
        res = mgr.compute(["die"], data_sources=["t"], ground_truths=["x"])
        assert res.scores.tolist() == [0.0] and res.metrics["reward/errors"] == 1.0
        ok = mgr.compute(["a"], data_sources=["t"], ground_truths=["x"])
    assert ok.scores.tolist() == [0.5]


def test_more_than_the_allowed_fraction_of_errors_stops_with_the_first_traceback(flaky_spec):
    from rlframe.rewards.manager import RewardErrorsExceeded

    responses, truths, _ = _inputs()  # 4 of 8 fail: exactly the fraction 0.5 still scores
    with RewardManager(fn_spec=flaky_spec, max_error_fraction=0.5) as mgr:
        assert mgr.compute(responses, data_sources=["t"] * 8, ground_truths=truths).metrics["reward/errors"] == 4.0
        with pytest.raises(RewardErrorsExceeded) as err:  # 5 of 8
            mgr.compute(responses[:7] + ["raise"], data_sources=["t"] * 8, ground_truths=truths)
    msg = str(err.value)
    assert err.value.failed == 5 and err.value.total == 8
    assert "5 of 8 samples" in msg and "reward.max_error_fraction=0.5" in msg
    assert msg.count("Traceback") == 1 and "boom on purpose" in msg  # the first failure, once
    assert "reward.function_path" in msg and "reward.function_name" in msg and "custom_fn" not in msg


def test_an_unknown_data_source_stops_naming_the_real_keys():
    from rlframe.rewards.manager import RewardErrorsExceeded

    with RewardManager(max_error_fraction=0.5) as mgr, pytest.raises(RewardErrorsExceeded) as err:
        mgr.compute(["42"] * 256, data_sources=["my_dataset"] * 256, ground_truths=["42"] * 256)
    msg = str(err.value)
    assert "256 of 256" in msg and "no built-in reward for data_source 'my_dataset'" in msg
    assert "reward.function_path" in msg and "custom_fn" not in msg


def test_the_same_traceback_is_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger="rlframe.rewards"), RewardManager() as mgr:
        res = mgr.compute(["42"] * 16, data_sources=["my_dataset"] * 16, ground_truths=["42"] * 16)
    assert res.metrics["reward/errors"] == 16.0  # no limit given: scored 0 and counted
    assert len([r for r in caplog.records if "reward function failed" in r.getMessage()]) == 1


def test_max_error_fraction_must_be_a_fraction():
    with pytest.raises(ValueError, match="max_error_fraction"):
        RewardManager(max_error_fraction=1.5)


REASONS = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str == ground_truth
    out = {"score": float(right), "exact": right, "tags": ["a"]}
    if not right:
        out["reason"] = f"expected {ground_truth}, got {solution_str}"
    if solution_str == "7":
        out["mixed"] = "seven"
    elif solution_str == "8":
        out["mixed"] = 8
    return out
"""


def test_string_extras_are_kept_per_sample_and_are_not_metrics(tmp_path):
    """A reward's string extras (a reason, a label) reach the batch per sample (RewardResult.texts, None where a
    sample returned none) for the generation dumps; they are not metrics. Booleans count 0/1; lists are dropped."""
    f = tmp_path / "reasons.py"
    f.write_text(REASONS)
    with RewardManager(fn_spec=RewardFnSpec(path=str(f), name="compute_score")) as mgr:
        res = mgr.compute(["7", "8", "9"], data_sources=["t"] * 3, ground_truths=["7", "7", "9"])
    assert res.texts["reason"].tolist() == [None, "expected 7, got 8", None]
    assert res.texts["mixed"].tolist() == ["seven", None, None]  # the number 8 is an extra value
    assert res.extras["mixed"][1] == 8.0 and np.isnan(res.extras["mixed"][0])
    assert res.extras["exact"].tolist() == [1.0, 0.0, 1.0]
    assert "reason" not in res.extras and "tags" not in res.extras and "tags" not in res.texts
    assert not any("reason" in k for k in res.metrics)
