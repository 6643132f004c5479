import json

import pytest

from rlframe.rewards.verifiers import (
    arithmetic_score,
    countdown_score,
    exact_match,
    extract_gsm8k_answer,
    gsm8k_score,
    math_score,
)
from rlframe.rewards.registry import default_compute_score


@pytest.mark.parametrize(
    "response, truth, expected",
    [("81", "81", 1.0), (" 81\n", "81", 1.0), ("81.0", "81", 1.0), ("1,234", "1234", 1.0),
     ("82", "81", 0.0), ("81 apples", "81", 0.0), ("", "81", 0.0), ("abc", "abc", 1.0)],
)
def test_exact_match(response, truth, expected):
    assert exact_match(response, truth) == expected


def test_arithmetic_score_is_strict():
    assert arithmetic_score(" 81\n", "81") == 1.0
    assert arithmetic_score("081", "81") == 0.0 and arithmetic_score("81.0", "81") == 0.0
    assert arithmetic_score("-5", "-5") == 1.0


def test_gsm8k_strict_and_flexible():
    text = "She has 3 + 4 = 7 apples.\n#### 7"
    assert extract_gsm8k_answer(text) == "7"
    assert gsm8k_score(text, "Natalia sold 48/2 = 24 clips.\n#### 7") == 1.0
    assert gsm8k_score("#### 1,200", "1200") == 1.0
    assert gsm8k_score("the answer is 7", "7") == 0.0  # strict needs ####
    assert gsm8k_score("the answer is 7", "7", method="flexible") == 1.0
    assert gsm8k_score("#### 8", "7", format_score=0.1) == 0.1
    assert extract_gsm8k_answer("first 3 then -2.5.", method="flexible") == "-2.5"
    with pytest.raises(ValueError, match="strict"):
        extract_gsm8k_answer("x", method="fuzzy")


@pytest.mark.parametrize(
    "response, truth, expected",
    [("The answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
     ("so $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
     ("$\\boxed{\\sqrt{4}}$", "2", 1.0),
     ("$\\boxed{3}$", "2", 0.0),
     ("no answer here", "2", 0.0)],
)
def test_math_score_uses_symbolic_equivalence(response, truth, expected):
    assert math_score(response, truth) == expected


def test_series_is_graded_on_the_whole_written_series():
    truth = "2:103,1:112,0:121"
    assert default_compute_score("series", "2:103,1:112,0:121 ", truth) == 1.0
    assert default_compute_score("series", "2:103,1:112,0:122", truth) == 0.0  # one digit anywhere fails it
    assert default_compute_score("series", "2:103,1:112", truth) == 0.0  # stopped early
    assert default_compute_score("series", "2:103,1:112,0:121,-1:130", truth) == 0.0  # went on
    assert default_compute_score("series", "121", truth) == 0.0  # the last value alone is not the series


def test_countdown_score():
    gt = json.dumps({"target": 22, "numbers": [3, 5, 7]})
    assert countdown_score("3*5+7", gt) == 1.0
    assert countdown_score("<answer>7+3*5</answer>", gt) == 1.0
    assert countdown_score("3*5+7 = 22", gt) == 1.0
    assert countdown_score("3*5+7+0", gt) == 0.0  # 0 is not one of the numbers
    assert countdown_score("5*5-3", gt) == 0.0  # 5 used twice
    assert countdown_score("3*5+5", gt) == 0.0  # wrong value
    assert countdown_score("__import__('os')", gt) == 0.0
    assert countdown_score("3*5+7", {"target": 22, "numbers": [3, 5, 7]}) == 1.0
    with pytest.raises(ValueError, match="target"):
        countdown_score("1", json.dumps({"numbers": [1]}))


def test_exact_match_compares_integers_exactly_and_decimals_within_a_tolerance():
    from rlframe.rewards.verifiers import exact_match, extract_gsm8k_answer

    assert exact_match("9007199254740993", "9007199254740992") == 0.0  # equal as float64
    assert exact_match("9007199254740993", "9,007,199,254,740,993") == 1.0
    assert exact_match("1,234.50", "1234.5") == 1.0 and exact_match("$12", "12.0") == 1.0
    assert exact_match("0.1000000000001", "0.1") == 1.0 and exact_match("0.1001", "0.1") == 0.0
    assert exact_match("abc", "abc") == 1.0 and exact_match("12", "12a") == 0.0
    assert extract_gsm8k_answer("so #### 1,234.50") == "1234.5"
