"""Synthetic verifiable tasks, written as parquet in the verl layout.

Three tasks, each with answers a rule can check (see `rlframe.rewards.verifiers`):

- `arithmetic`: "23+58=" -> "81". Difficulty is the number of digits per operand and the set of
  operators. Train and test are disjoint: the (a, op, b) problems are drawn without replacement
  from one seeded permutation, so a held-out accuracy measures generalisation, not recall.
- `countdown`: "3,5,7->22:" -> an expression such as "3*5+7" that uses each given number at most
  once and evaluates to the target (TinyZero-style). Targets are built from a random expression
  over the numbers, so every problem has at least one solution (stored in `extra_info`).
- `series`: an arithmetic series written out with a countdown of the terms left: "94+9x3=" ->
  "2:103,1:112,0:121" (start 94, step 9, 3 terms; each term is "left:value"). A problem of k terms
  has about 7k characters; k is drawn with a geometric tail (`SeriesSpec`), so most responses are
  tens of tokens and a few are hundreds: the long-tailed, generation-bound workload of the
  asynchronous modes (docs/async.md). The reward is the exact text; one wrong digit anywhere fails it,
  so long series are the hard ones.

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

TASKS = ("arithmetic", "countdown", "series")
# Tasks whose ground truth is not the answer text, and what it is instead: their rows keep the answer
# text (one solution) as extra_info["solution"], which their pre-training trains on.
GROUND_TRUTH_NOT_ANSWER = {"countdown": "the target and the numbers (JSON)"}
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
class SeriesSpec:
    """Series from a start 0..`max_start` by a step 1..`max_step`, of 1..`max_terms` terms; the number
    of terms past one is drawn geometric with ratio `tail` (each further term `tail` times as likely),
    cut at `max_terms`. Distinct problems only. The default split (5000 + 500) has a median of 39
    response characters, a 90th percentile of about 140 and a longest of about 270 (40 terms)."""

    max_start: int = 99
    max_step: int = 9
    max_terms: int = 40
    tail: float = 0.9


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


def series_solution(start: int, step: int, terms: int) -> str:
    """The written series: each term is "left:value", the count of terms still to come and the value."""
    return ",".join(f"{terms - i}:{start + step * i}" for i in range(1, terms + 1))


def series_problem(rng: random.Random, spec: SeriesSpec) -> tuple[str, str]:
    """(prompt, solution) of one drawn series."""
    start, step, terms = rng.randint(0, spec.max_start), rng.randint(1, spec.max_step), 1
    while terms < spec.max_terms and rng.random() < spec.tail:
        terms += 1
    return f"{start}+{step}x{terms}=", series_solution(start, step, terms)


def series_rows(*, num_train: int, num_test: int, spec: SeriesSpec, seed: int) -> dict[str, list[dict]]:
    """Disjoint train/test rows of the series task (prompts deduplicated across splits)."""
    if not (spec.max_start >= 0 and spec.max_step >= 1 and spec.max_terms >= 1 and 0 <= spec.tail < 1):
        raise ValueError(f"series needs max_start >= 0, max_step >= 1, max_terms >= 1 and 0 <= tail < 1; got {spec}")
    rng = random.Random(seed)
    problems = distinct_draws(lambda: series_problem(rng, spec), num_train + num_test, lambda problem: problem[0])
    if len(problems) < num_train + num_test:
        raise ValueError(f"only {len(problems)} distinct series exist with {spec}; raise max_terms, max_start or max_step")
    # Short series are few (one term: 900) and the first drawn: shuffled, both splits mix lengths alike.
    rng.shuffle(problems)
    splits = {"train": problems[:num_train], "test": problems[num_train:]}
    return {
        split: [_row(prompt, solution, source="series", split=split, index=i,
                     extra={"terms": solution.count(",") + 1}) for i, (prompt, solution) in enumerate(items)]
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
    p.add_argument("--max-terms", type=int, default=40, help="series: most terms in a series")
    return p.parse_args(argv)


def generate(args: argparse.Namespace) -> dict[str, list[dict]]:
    if args.task == "arithmetic":
        spec = ArithmeticSpec(digits=args.digits, min_digits=args.min_digits, ops=args.ops)
        return arithmetic_rows(num_train=args.num_train, num_test=args.num_test, spec=spec, seed=args.seed)
    if args.task == "series":
        return series_rows(num_train=args.num_train, num_test=args.num_test, seed=args.seed,
                           spec=SeriesSpec(max_terms=args.max_terms))
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
