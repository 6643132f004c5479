"""Synthetic verifiable tasks, written as parquet in the verl layout.

Three tasks, each with answers a rule can check (see `rlframe.rewards.verifiers`):

- `arithmetic`: "23+58=" -> "81". Difficulty is the number of digits per operand and the set of
  operators. Train and test are disjoint: the (a, op, b) problems are drawn without replacement
  from one seeded permutation, so a held-out accuracy measures generalisation, not recall.
- `countdown`: "3,5,7->22:" -> an expression such as "3*5+7" that uses each given number at most
  once and evaluates to the target (TinyZero-style). Targets are built from a random expression
  over the numbers, so every problem has at least one solution (stored in `extra_info`).
- `stepwise`: a sum of single-digit numbers worked one addition at a time, each step rewriting the
  rest: "3+8+1+9=" -> "11+1+9=12+9=21". A problem of k terms takes k-1 steps and about k^2
  characters; k is drawn with a geometric tail (`StepwiseSpec`), so most responses are tens of
  tokens and a few are hundreds: the long-tailed, generation-bound workload for the asynchronous modes (docs/placement.md). The
  reward reads the number after the last "=".

Rows: `prompt` = [{"role": "user", "content": ...}], `data_source`, `ability`,
`reward_model` = {"ground_truth": str, "style": "rule"}, `extra_info` = {"split", "index", ...}.
Countdown's ground truth is a JSON string {"target": int, "numbers": [int, ...]}.

Command: `python -m rlframe.data.synthetic --task arithmetic --out DIR [--digits 2 --ops +]`
writes DIR/train.parquet and DIR/test.parquet. Everything is a function of `--seed`.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

TASKS = ("arithmetic", "countdown", "stepwise")
# Tasks whose ground truth is not the answer text, and what it is instead: their rows keep the answer
# text (one solution) as extra_info["solution"], which their pre-training trains on.
GROUND_TRUTH_NOT_ANSWER = {"countdown": "the target and the numbers (JSON)",
                           "stepwise": "the total alone, while its answers are the worked steps"}
_OPS = "+-*"


@dataclass(frozen=True)
class ArithmeticSpec:
    """Difficulty knobs: operands have `min_digits..digits` digits; `ops` is a subset of "+-*"."""

    digits: int = 2
    min_digits: int = 1
    ops: str = "+"
    allow_negative: bool = False


@dataclass(frozen=True)
class CountdownSpec:
    """`count` numbers from 1..`max_number` per problem (the target one expression of them reaches)."""

    count: int = 3
    max_number: int = 9


@dataclass(frozen=True)
class StepwiseSpec:
    """Sums of `min_terms..max_terms` numbers from 1..`max_operand`; the number of terms past
    `min_terms` is drawn geometric with ratio `tail` (each further term `tail` times as likely), cut at
    `max_terms`. Distinct problems only: short sums are few (81 of two terms), so the default split
    (5000 + 500) has a median of 6 terms and 34 response characters, and 8% of its sums have 15 or 16
    terms (about 230-258 characters)."""

    min_terms: int = 2
    max_terms: int = 16
    tail: float = 0.8
    max_operand: int = 9


def _validate_arith(spec: ArithmeticSpec) -> None:
    if not 1 <= spec.min_digits <= spec.digits <= 6:
        raise ValueError(
            f"arithmetic digits must satisfy 1 <= min_digits ({spec.min_digits}) <= digits "
            f"({spec.digits}) <= 6; pick smaller numbers"
        )
    if not spec.ops or any(op not in _OPS for op in spec.ops):
        raise ValueError(f"arithmetic ops {spec.ops!r} must be a non-empty subset of {_OPS!r}")


def _operand(rng: random.Random, spec: ArithmeticSpec) -> int:
    lo = 0 if spec.min_digits == 1 else 10 ** (spec.min_digits - 1)
    return rng.randint(lo, 10**spec.digits - 1)


def distinct_draws(draw, n: int, prompt) -> list:
    """Up to `n` results of `draw()` with distinct `prompt(result)`, in the order drawn. Rejection
    sampling: the cap of 50 n + 1000 draws ends it when fewer than `n` distinct problems exist (the
    caller says so)."""
    seen: set[str] = set()
    out: list = []
    for _ in range(50 * n + 1000):
        if len(out) == n:
            break
        item = draw()
        if prompt(item) not in seen:
            seen.add(prompt(item))
            out.append(item)
    return out


def arithmetic_problems(n: int, *, spec: ArithmeticSpec, seed: int) -> list[tuple[str, str]]:
    """`n` distinct (prompt, answer) pairs, e.g. ("23+58=", "81"), deterministic from `seed`."""
    _validate_arith(spec)
    rng = random.Random(seed)

    def draw() -> tuple[str, str]:
        a, b, op = _operand(rng, spec), _operand(rng, spec), rng.choice(spec.ops)
        if op == "-" and not spec.allow_negative and a < b:
            a, b = b, a
        return f"{a}{op}{b}=", str(eval_binary(a, op, b))

    out = distinct_draws(draw, n, lambda problem: problem[0])
    if len(out) < n:
        raise ValueError(
            f"asked for {n} distinct arithmetic problems but only {len(out)} exist with "
            f"digits={spec.digits}, ops={spec.ops!r}; raise --digits or lower --num-train/--num-test"
        )
    return out


def eval_binary(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def countdown_problem(rng: random.Random, *, count: int, max_number: int) -> tuple[list[int], int, str]:
    """Numbers, a reachable positive target and one solution expression (no division)."""
    while True:
        nums = [rng.randint(1, max_number) for _ in range(count)]
        order = rng.sample(nums, k=len(nums))
        expr, value = str(order[0]), order[0]
        for x in order[1:]:
            op = rng.choice("+-*")
            # Left-to-right with precedence made explicit, so the stored solution evaluates as written.
            expr = f"({expr}){op}{x}" if op == "*" and ("+" in expr or "-" in expr) else f"{expr}{op}{x}"
            value = eval_binary(value, op, x)
        if 0 < value <= 10 * max_number:
            return nums, value, expr


def stepwise_solution(terms: list[int]) -> str:
    """The worked sum: each step adds the first two numbers and copies the rest ("11+1+9=12+9=21")."""
    steps, rest = [], list(terms)
    while len(rest) > 1:
        rest = [rest[0] + rest[1], *rest[2:]]
        steps.append("+".join(map(str, rest)))
    return "=".join(steps)


def _stepwise_prompt(terms: list[int]) -> str:
    return "+".join(map(str, terms)) + "="


def stepwise_terms(rng: random.Random, spec: StepwiseSpec) -> list[int]:
    k = spec.min_terms
    while k < spec.max_terms and rng.random() < spec.tail:
        k += 1
    return [rng.randint(1, spec.max_operand) for _ in range(k)]


def stepwise_rows(*, num_train: int, num_test: int, spec: StepwiseSpec, seed: int) -> dict[str, list[dict]]:
    """Disjoint train/test rows of the stepwise sum (prompts deduplicated across splits)."""
    if not (2 <= spec.min_terms <= spec.max_terms and 0 <= spec.tail < 1 and 1 <= spec.max_operand <= 9):
        raise ValueError(f"stepwise needs 2 <= min_terms <= max_terms, 0 <= tail < 1 and single-digit operands "
                         f"(1 <= max_operand <= 9); got {spec}")
    rng = random.Random(seed)
    problems = distinct_draws(lambda: stepwise_terms(rng, spec), num_train + num_test, _stepwise_prompt)
    if len(problems) < num_train + num_test:
        raise ValueError(f"only {len(problems)} distinct stepwise problems exist with {spec}; raise max_terms or max_operand")
    # Short sums are few (81 of two terms) and the first drawn: shuffled, both splits mix lengths alike.
    rng.shuffle(problems)
    splits = {"train": problems[:num_train], "test": problems[num_train:]}
    return {
        split: [_row(_stepwise_prompt(t), str(sum(t)), source="stepwise", split=split, index=i,
                     extra={"solution": stepwise_solution(t), "terms": len(t)}) for i, t in enumerate(items)]
        for split, items in splits.items()
    }


def _row(prompt: str, answer_gt: str, *, source: str, split: str, index: int, extra: dict) -> dict:
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "data_source": source,
        "ability": "math",
        "reward_model": {"ground_truth": answer_gt, "style": "rule"},
        "extra_info": {"split": split, "index": index, **extra},
    }


def arithmetic_rows(*, num_train: int, num_test: int, spec: ArithmeticSpec, seed: int) -> dict[str, list[dict]]:
    """Disjoint train/test rows for the arithmetic task."""
    problems = arithmetic_problems(num_train + num_test, spec=spec, seed=seed)
    splits = {"train": problems[:num_train], "test": problems[num_train:]}
    return {
        split: [
            _row(p, a, source="arithmetic", split=split, index=i, extra={"answer": a})
            for i, (p, a) in enumerate(items)
        ]
        for split, items in splits.items()
    }


def countdown_rows(
    *, num_train: int, num_test: int, seed: int, count: int = 3, max_number: int = 9
) -> dict[str, list[dict]]:
    """Disjoint train/test rows for countdown (prompts deduplicated across splits)."""
    if count < 2 or max_number < 1:
        raise ValueError(f"countdown needs count >= 2 numbers (got {count}) and max_number >= 1 (got {max_number})")
    rng = random.Random(seed)

    def draw() -> tuple[str, list[int], int, str]:
        nums, target, expr = countdown_problem(rng, count=count, max_number=max_number)
        return ",".join(map(str, nums)) + f"->{target}:", nums, target, expr

    problems = distinct_draws(draw, num_train + num_test, lambda problem: problem[0])
    if len(problems) < num_train + num_test:
        raise ValueError(f"only {len(problems)} distinct countdown problems exist; raise --max-number or --count")
    out: dict[str, list[dict]] = {"train": [], "test": []}
    for i, (prompt, nums, target, expr) in enumerate(problems):
        split = "train" if i < num_train else "test"
        gt = json.dumps({"target": target, "numbers": nums})
        out[split].append(
            _row(prompt, gt, source="countdown", split=split, index=len(out[split]), extra={"solution": expr})
        )
    return out


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    """Write rows (verl layout) to a parquet file; nested fields become parquet structs/lists."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlframe.data.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=TASKS, required=True)
    p.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
    p.add_argument("--num-train", type=int, default=5000)
    p.add_argument("--num-test", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digits", type=int, default=2, help="arithmetic: max digits per operand")
    p.add_argument("--min-digits", type=int, default=1, help="arithmetic: min digits per operand")
    p.add_argument("--ops", default="+", help="arithmetic: operators, subset of '+-*'")
    p.add_argument("--count", type=int, default=3, help="countdown: how many numbers")
    p.add_argument("--max-number", type=int, default=9, help="countdown: numbers are 1..max")
    p.add_argument("--max-terms", type=int, default=16, help="stepwise: most numbers in a sum")
    return p.parse_args(argv)


def generate(args: argparse.Namespace) -> dict[str, list[dict]]:
    if args.task == "arithmetic":
        spec = ArithmeticSpec(digits=args.digits, min_digits=args.min_digits, ops=args.ops)
        return arithmetic_rows(num_train=args.num_train, num_test=args.num_test, spec=spec, seed=args.seed)
    if args.task == "stepwise":
        return stepwise_rows(num_train=args.num_train, num_test=args.num_test, seed=args.seed,
                             spec=StepwiseSpec(max_terms=args.max_terms))
    return countdown_rows(
        num_train=args.num_train, num_test=args.num_test, seed=args.seed, count=args.count, max_number=args.max_number
    )


def write_splits(rows: dict[str, list[dict]], out_dir: str | Path, *, task: str) -> dict[str, Path]:
    """Write each split to `out_dir/<split>.parquet`, say so, and return the paths."""
    paths = {split: write_parquet(r, Path(out_dir) / f"{split}.parquet") for split, r in rows.items()}
    for split, path in paths.items():
        print(f"{task}: wrote {len(rows[split])} {split} rows to {path}")
    return paths


def main(argv: list[str] | None = None) -> dict[str, Path]:
    args = _parse_args(argv)
    return write_splits(generate(args), args.out, task=args.task)


if __name__ == "__main__":
    main()
