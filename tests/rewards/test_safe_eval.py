import pytest

from rlframe.rewards.safe_eval import UnsafeExpression, evaluate_expression, number_literals


def test_safe_eval_accepts_arithmetic_only():
    assert evaluate_expression("(3+5)*7") == 56
    assert evaluate_expression("-2*3 - 1") == -7
    assert evaluate_expression("7/2") == 3.5
    assert number_literals("(3+5)*7") == [3, 5, 7]
    for bad in ["__import__('os')", "2**100", "a+1", "1/0", "", "[1,2]", "3 if 1 else 2", "9" * 30]:
        with pytest.raises(UnsafeExpression):
            evaluate_expression(bad)
