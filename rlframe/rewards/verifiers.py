"""Rule-based verifiers: response string + ground truth -> score in [0, 1].

- `exact_match`: the whole response, stripped, is the answer (numerically equal when numeric);
  `arithmetic_score` is its strict string form for the synthetic arithmetic and series tasks.
- `gsm8k_score`: GSM8K-style final answers ("#### 42", or the last number in flexible mode).
- `math_score`: competition-math answers compared symbolically with the `math-verify` package
  (LaTeX/sympy parsing and equivalence are its job, not ours).
- `tool_arithmetic_score`: the number in the last `<answer>...</answer>` of a response that may hold
  tool calls (`rlframe/data/tool_task.py`); numbers inside calls never count.
- `countdown_score`: an arithmetic expression that uses the given numbers at most once each and
  evaluates to the target, checked with `rlframe.rewards.safe_eval` (no `eval`).
"""

from __future__ import annotations

import json
import re
import threading
from decimal import Decimal, InvalidOperation

from rlframe.rewards.safe_eval import UnsafeExpression, evaluate_expression, number_literals

_NUMBER = r"-?[\d,]*\.?\d+"
MATH_TIMEOUT_S = 5


REL_TOL = Decimal("1e-9")  # non-integers: |got - want| <= REL_TOL * max(1, |want|)


def _as_decimal(text: str) -> Decimal | None:
    """The number a text spells ('1,234.50', '$3', '-2e3'), exactly, or None."""
    try:
        value = Decimal(text.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _normalize_number(text: str) -> str:
    """'1,234.50' -> '1234.5'; keeps non-numbers as stripped text. Exact: no binary float on the way."""
    value = _as_decimal(text)
    if value is None:
        return text.replace(",", "").replace("$", "").strip()
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def numbers_equal(got: str, want: str) -> bool:
    """Integers compare exactly (9007199254740993 != 9007199254740992, which float64 cannot tell
    apart); other numbers within a relative REL_TOL (1e-9) of the ground truth."""
    a, b = _as_decimal(got), _as_decimal(want)
    if a is None or b is None:
        return False
    if a == a.to_integral_value() and b == b.to_integral_value():
        return a == b
    return abs(a - b) <= REL_TOL * max(Decimal(1), abs(b))


def exact_match(solution_str: str, ground_truth: str, *, numeric: bool = True) -> float:
    """1.0 if the stripped response equals the ground truth; when both are numbers, `numbers_equal`
    (integers exactly, others within a relative 1e-9)."""
    got, want = solution_str.strip(), str(ground_truth).strip()
    if numeric and _as_decimal(got) is not None and _as_decimal(want) is not None:
        return float(numbers_equal(got, want))
    return float(got == want)


def arithmetic_score(solution_str: str, ground_truth: str) -> float:
    """Synthetic arithmetic: the stripped response is exactly the canonical answer ("81", not "081")."""
    return exact_match(solution_str, ground_truth, numeric=False)


def extract_gsm8k_answer(solution_str: str, *, method: str = "strict") -> str | None:
    """The final answer of a GSM8K-style response, or None.

    strict: the number after the last "####" (the GSM8K reference format).
    flexible: the last number anywhere in the text that is not empty or a lone ".".
    """
    if method == "strict":
        found = re.findall(r"####\s*(" + _NUMBER + ")", solution_str)
        return _normalize_number(found[-1]) if found else None
    if method == "flexible":
        found = [m for m in re.findall(_NUMBER, solution_str) if m not in ("", ".")]
        return _normalize_number(found[-1]) if found else None
    raise ValueError(f"unknown GSM8K extraction method {method!r}; use 'strict' or 'flexible'")


def gsm8k_score(solution_str: str, ground_truth: str, *, method: str = "strict", format_score: float = 0.0) -> float:
    """1.0 for a correct final answer, `format_score` for a wrong but extractable one, else 0."""
    answer = extract_gsm8k_answer(solution_str, method=method)
    if answer is None:
        return 0.0
    truth = _normalize_number(str(ground_truth).split("####")[-1])
    return 1.0 if answer == truth else format_score


def math_score(solution_str: str, ground_truth: str) -> float:
    """Symbolic equivalence of the response's final answer and the ground truth via math-verify.

    The ground truth is wrapped in `$...$` when it has no delimiters so that LaTeX such as
    `\\frac{1}{2}` parses; math-verify picks the answer out of the response (boxed first).
    """
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set; elsewhere (threaded
    # Ray actors) they are off and the RewardManager's per-batch timeout bounds a stuck sample.
    timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    truth = str(ground_truth)
    if "$" not in truth and "\\boxed" not in truth:
        truth = f"${truth}$"
    gold = parse(truth, parsing_timeout=timeout)
    pred = parse(solution_str, parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=timeout))


def parse_countdown_truth(ground_truth) -> tuple[int, list[int]]:
    """(target, numbers) from a dict or JSON string {"target": int, "numbers": [int, ...]}."""
    data = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
    try:
        return int(data["target"]), [int(n) for n in data["numbers"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"countdown ground truth must have 'target' and 'numbers' (got {ground_truth!r})"
        ) from exc


def extract_countdown_expression(solution_str: str) -> str:
    """The expression of a response: inside <answer>...</answer> if present, else the first line."""
    tagged = re.findall(r"<answer>(.*?)</answer>", solution_str, flags=re.S)
    text = tagged[-1] if tagged else solution_str.strip().split("\n")[0]
    return text.split("=")[0].strip()


def countdown_score(solution_str: str, ground_truth, *, format_score: float = 0.0) -> float:
    """1.0 if the expression uses each given number at most once and equals the target.

    `format_score` is given to a well-formed expression that is wrong (0 by default).
    """
    target, numbers = parse_countdown_truth(ground_truth)
    expr = extract_countdown_expression(solution_str)
    try:
        used = number_literals(expr)
        value = evaluate_expression(expr)
    except UnsafeExpression:
        return 0.0
    pool = list(numbers)
    for n in used:
        if n not in pool:
            return format_score
        pool.remove(n)
    return 1.0 if abs(value - target) < 1e-9 else format_score


def extract_tagged_answer(solution_str: str) -> str | None:
    """The stripped text of the last `<answer>...</answer>` of a response, or None."""
    found = re.findall(r"<answer>(.*?)</answer>", solution_str, flags=re.S)
    return found[-1].strip() if found else None


def tool_arithmetic_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last `<answer>` of the response holds the ground truth's number, else 0.

    The response is the policy's text of a multi-turn rollout, tool calls included (tool results are
    not in it): `<tool_call>{"name": "calculator", ...}</tool_call>` then `<answer>17954</answer>`.
    Only the tagged answer counts, so the numbers of a call (or a call without an answer) score 0.
    """
    answer = extract_tagged_answer(solution_str)
    if answer is None or not re.fullmatch(_NUMBER, answer):
        return 0.0
    return float(_normalize_number(answer) == _normalize_number(str(ground_truth)))
