import json

import pytest

from rlframe.rewards.registry import RewardFnSpec, default_compute_score, load_reward_fn


def test_default_dispatch_by_data_source():
    assert default_compute_score("arithmetic", "81", "81") == 1.0
    assert default_compute_score("countdown", "3*5+7", json.dumps({"target": 22, "numbers": [3, 5, 7]})) == 1.0
    assert default_compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    assert default_compute_score("lighteval/MATH", "$\\boxed{2}$", "2") == 1.0
    gt = {"instruction_id_list": ["case:lowercase"], "kwargs": [{}]}
    assert default_compute_score("ifeval", "abc", gt)["score"] == 1.0
    with pytest.raises(ValueError, match="no built-in reward for data_source 'nope'"):
        default_compute_score("nope", "x", "y")


def test_load_custom_reward_fn(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str == ground_truth), 'len': len(solution_str)}\n"
        "def by_kw(*, data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0\n"
    )
    fn = load_reward_fn(f, "compute_score")
    assert fn("s", "a", "a") == {"score": 1.0, "len": 1}
    assert RewardFnSpec(path=str(f)).load()("s", "a", "b")["score"] == 0.0
    with pytest.raises(ValueError, match="positionally or by keyword"):
        load_reward_fn(f, "by_kw")  # keyword-only parameters cannot be called positionally


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*reward.function_path"):
        load_reward_fn(tmp_path / "absent.py", "compute_score")


def test_missing_function_lists_what_is_there(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def score(a, b, c, d=None):\n    return 0.0\n")
    with pytest.raises(ValueError, match=r"defines no 'compute_score'.*\['score'\]"):
        load_reward_fn(f, "compute_score")


@pytest.mark.parametrize(
    "source",
    ["def compute_score(solution_str, ground_truth):\n    return 0.0\n",
     "def compute_score(data_source, solution_str, ground_truth, extra_info, other):\n    return 0.0\n",
     "def compute_score(a, b, c, d=None):\n    return 0.0\n",
     "compute_score = 3\n"],
)
def test_wrong_signature_is_rejected(tmp_path, source):
    f = tmp_path / "r.py"
    f.write_text(source)
    with pytest.raises(ValueError, match="compute_score"):
        load_reward_fn(f, "compute_score")


def test_import_error_in_file_is_reported(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("import no_such_module_here\n")
    with pytest.raises(ValueError, match="importing reward function file.*no_such_module_here"):
        load_reward_fn(f)
