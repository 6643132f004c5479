"""Safe evaluation of small arithmetic expressions (for countdown-style rewards), without eval().

The expression is parsed with `ast.parse(mode="eval")` and walked: only integer/float literals,
the binary operators + - * /, unary minus/plus and parentheses are accepted. Anything else
(names, calls, attributes, power, huge literals) raises `UnsafeExpression`, which a verifier
turns into a score of 0. Length and magnitude caps stop a response from making the reward
worker burn CPU or memory.
"""

from __future__ import annotations

import ast

MAX_LENGTH = 200
MAX_MAGNITUDE = 1e12


class UnsafeExpression(ValueError):
    """The text is not a plain arithmetic expression over number literals."""


_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _parse(expr: str) -> ast.Expression:
    if not expr or len(expr) > MAX_LENGTH:
        raise UnsafeExpression(f"expression is empty or longer than {MAX_LENGTH} characters")
    try:
        return ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise UnsafeExpression(f"not an arithmetic expression: {expr!r}") from exc


def _walk(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise UnsafeExpression("division by zero")
        value = _BINOPS[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = -_walk(node.operand) if isinstance(node.op, ast.USub) else _walk(node.operand)
    else:
        raise UnsafeExpression(f"unsupported syntax {type(node).__name__}")
    if abs(value) > MAX_MAGNITUDE:
        raise UnsafeExpression("value out of range")
    return value


def evaluate_expression(expr: str) -> float:
    """Value of an arithmetic expression such as "(3+5)*7"; raises UnsafeExpression otherwise."""
    return _walk(_parse(expr).body)


def number_literals(expr: str) -> list[int | float]:
    """The number literals of an expression, in source order (unary minus not folded in)."""
    tree = _parse(expr)
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    nodes.sort(key=lambda n: (n.lineno, n.col_offset))
    for n in nodes:
        if type(n.value) not in (int, float):
            raise UnsafeExpression(f"non-numeric literal {n.value!r}")
    return [n.value for n in nodes]
