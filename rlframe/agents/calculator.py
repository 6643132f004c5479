"""The built-in `calculator` tool: exact evaluation of an arithmetic expression, without eval().

Like rlframe/rewards/safe_eval.py, the expression is parsed with `ast.parse(mode="eval")` and walked
over a whitelist: int and float literals, + - * / // % **, unary minus/plus and parentheses.
Names, attributes, calls, comparisons, bools, strings and everything else raise `UnsafeExpression`
(safe_eval's error class). The calculator differs from safe_eval's `evaluate_expression` where a
tool must: more operators, a far larger range, and exact integers:

  * integer arithmetic stays exact (Python ints); `a / b` of two ints whose quotient is an integer
    gives that integer ("12/4" -> "3"), otherwise the correctly rounded float ("1/3");
  * integers are capped at MAX_INT_DIGITS digits and a power is refused *before* it is computed
    when its result would be larger, so "9**9**9" costs nothing; floats must stay finite;
  * division or modulo by zero raises ZeroDivisionError, as in Python.

The result is returned as text: `str(int)` or `repr(float)` (shortest round-trip form), so the same
expression always gives the same text.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

from rlframe.rewards.safe_eval import UnsafeExpression

MAX_LENGTH = 500
MAX_INT_DIGITS = 100
_INT_LIMIT = 10**MAX_INT_DIGITS

DESCRIPTION = (
    "Evaluate an arithmetic expression exactly: integers and decimals, + - * / // % ** and parentheses "
    "(e.g. \"(12+3)*4**2\"). Integer arithmetic is exact."
)
PARAMETERS = {
    "type": "object",
    "properties": {
        "expression": {"type": "string", "description": "the arithmetic expression, e.g. \"47*382\""},
    },
    "required": ["expression"],
}


def _true_div(a, b):
    if type(a) is int and type(b) is int:
        if b == 0:
            raise ZeroDivisionError("division by zero")
        q = Fraction(a, b)
        return q.numerator if q.denominator == 1 else float(q)
    return a / b


def _power(a, b):
    if type(b) is int and type(a) is int and abs(a) > 1 and b > 0:
        if b * math.log10(abs(a)) > MAX_INT_DIGITS:
            raise UnsafeExpression(f"exponent too large: the result of {a}**{b} has more than {MAX_INT_DIGITS} digits")
    try:
        value = a**b
    except OverflowError as exc:
        raise UnsafeExpression("value out of range") from exc
    if isinstance(value, complex):
        raise UnsafeExpression(f"({a})**({b}) is not a real number")
    return value


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _true_div,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}


def _check(value: int | float) -> int | float:
    if type(value) is int:
        if abs(value) >= _INT_LIMIT:
            raise UnsafeExpression(f"value out of range (integers have at most {MAX_INT_DIGITS} digits)")
    elif not math.isfinite(value):
        raise UnsafeExpression("value out of range")
    return value


def _walk(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _walk(node.left), _walk(node.right)
        try:
            return _check(_BINOPS[type(node.op)](left, right))
        except OverflowError as exc:  # float results too large to represent
            raise UnsafeExpression("value out of range") from exc
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _walk(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name):
        raise UnsafeExpression(f"names are not allowed ({node.id!r}); use numbers only")
    if isinstance(node, ast.Constant):
        raise UnsafeExpression(f"only int and float literals are allowed, not {node.value!r}")
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise UnsafeExpression(f"unsupported syntax {what}; use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression such as "(3+5)*7" as text; raises UnsafeExpression
    (a ValueError) for anything that is not one, ZeroDivisionError for a division by zero."""
    if not isinstance(expression, str):
        raise UnsafeExpression(f"the expression must be a string, not {type(expression).__name__}")
    expr = expression.strip()
    if not expr or len(expr) > MAX_LENGTH:
        raise UnsafeExpression(f"the expression is empty or longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expr, mode="eval")
        value = _walk(tree.body)
    except (SyntaxError, ValueError) as exc:  # ValueError: e.g. integer literals past Python's digit limit
        if isinstance(exc, UnsafeExpression):
            raise
        raise UnsafeExpression(f"not an arithmetic expression: {expr!r}") from exc
    except RecursionError as exc:
        raise UnsafeExpression("the expression is nested too deeply") from exc
    return str(value) if type(value) is int else repr(value)


def calculator(expression: str) -> str:
    """The built-in calculator tool's function."""
    return calculate(expression)
