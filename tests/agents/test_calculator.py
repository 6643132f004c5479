import pytest

from rlframe.agents.calculator import MAX_INT_DIGITS, calculate, calculator
from rlframe.rewards.safe_eval import UnsafeExpression


@pytest.mark.parametrize("expr,expected", [
    ("12*34", "408"), ("47*382", "17954"), ("(1+2)*3", "9"), ("2+3*4", "14"), ("-3+5", "2"), ("-(-3)", "3"),
    ("+4", "4"), ("7//2", "3"), ("-7//2", "-4"), ("-7%3", "2"), ("7%3", "1"), ("2**10", "1024"), ("2**-1", "0.5"),
    ("12/4", "3"), ("1/4", "0.25"), ("1/3", "0.3333333333333333"), ("7/2", "3.5"), ("3.5/0.5", "7.0"),
    ("0.1+0.2", "0.30000000000000004"), ("1.5*2", "3.0"), (" 2 * ( 3 + 4 ) ", "14"),
    ("123456789*987654321", "121932631112635269"),  # exact, where a float would round
    ("99999999999999999*99999999999999999", "9999999999999999800000000000000001"),
    ("(10**50+1)/1", "1" + "0" * 49 + "1"), ("10**99", "1" + "0" * 99), ("1**10**99", "1"),
])
def test_values(expr, expected):
    assert calculate(expr) == expected
    assert calculator(expression=expr) == expected


def test_division_by_zero_is_python_s_error():
    for expr in ("1/0", "7//0", "5%0", "1.0/0", "0**-1"):
        with pytest.raises(ZeroDivisionError):
            calculate(expr)


@pytest.mark.parametrize("expr,msg", [
    ("x+1", "names are not allowed"), ("__import__('os')", "unsupported syntax Call"),
    ("(1).real", "unsupported syntax Attribute"), ("abs(-1)", "unsupported syntax Call"), ("1<2", "Compare"),
    ("True+1", "only int and float literals"), ("'a'*3", "only int and float literals"), ("1j", "only int and float"),
    ("1 << 3", "unsupported syntax LShift"), ("~1", "unsupported syntax Invert"), ("[1]", "List"),
    ("9**9**9", "exponent too large"), ("2**1000", "exponent too large"), ("10**100", "out of range"),
    ("10**99*10", "out of range"), ("2.0**5000", "out of range"), ("1e308*10", "out of range"),
    ("(-8)**0.5", "not a real number"), ("", "empty"), ("1+" * 300 + "1", "longer than"), ("1+", "not an arithmetic"),
    ("lambda: 1", "Lambda"),
])
def test_refusals(expr, msg):
    with pytest.raises(UnsafeExpression, match=msg):
        calculate(expr)


def test_refusals_are_fast_and_bounded():
    import time

    t0 = time.perf_counter()
    for expr in ("9**9**9**9", "(10**99)**(10**99)", "2**(2**(2**(2**10)))", "-" * 450 + "1"):
        try:
            calculate(expr)
        except UnsafeExpression:
            pass
    assert time.perf_counter() - t0 < 1.0
    assert len(calculate("9" * MAX_INT_DIGITS)) == MAX_INT_DIGITS


def test_not_a_string():
    with pytest.raises(UnsafeExpression, match="must be a string"):
        calculate(12)
