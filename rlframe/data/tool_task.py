"""A task the tiny model solves reliably only with a tool: products of a 2-digit and a 3-digit number.

"What is 47*382?" -> "<answer>17954</answer>". A model of a million parameters does not learn
5-digit products from a short pre-training, but it can learn to copy the two numbers into a call of
the `calculator` tool and the tool's result into its answer:

    system     the tool documentation (`tool_system_prompt([CALCULATOR])`)
    user       What is 47*382?
    assistant  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "47*382"}}\\n</tool_call>
    tool       17954
    assistant  <answer>17954</answer>

The verifier (`tool_arithmetic` in rlframe/rewards/verifiers.py) reads the number in the last
`<answer>...</answer>` of the policy's text, so calls and their arguments never count as answers.

Rows follow the verl layout of `rlframe.data.synthetic` (`prompt` = system + user messages,
`data_source` = "tool_arithmetic", `reward_model.ground_truth` = the product as a string,
`extra_info` = split, index, operands, expression); the dataset applies the tokenizer's chat template
with the generation prompt. Train and test problems are disjoint (drawn without replacement from one
seeded stream). `sft_conversations` gives the pre-training transcripts, some of which answer without
the tool (answers the model mostly gets wrong): 80% of those whose a is in the lower half of its
range (a < 55), 20% of the others. The pre-trained policy then calls the tool for some prompts and
not for others (greedy), samples both behaviours for every prompt, and RL has a choice to reinforce.

Command: `python -m rlframe.data.tool_task --out DIR` writes DIR/train.parquet and DIR/test.parquet.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

from rlframe.data.chat_format import format_tool_call, tool_system_prompt

DATA_SOURCE = "tool_arithmetic"

# Kept short: the system turn is in every sequence the tiny model trains on and generates from.
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
SYSTEM = "Answer with <answer>number</answer>."
# Tokens of every prompt of the task (system + user message, chat template with the generation prompt)
# under the agent preset's tokenizer: data.prompt_length below it leaves no usable row (config/task_fit.py;
# tests/config/test_task_fit.py measures it with the shipped tokenizer)
PROMPT_TOKENS = 113


@dataclass(frozen=True)
class ToolArithmeticSpec:
    """Products a*b with `a_digits`-digit a and `b_digits`-digit b. A pre-training transcript answers
    without the tool with probability `direct_low` when a is in the lower half of its range, else
    `direct_high`. `version` names the tokenizer and transcript recipe (part of the pre-training
    cache key)."""

    a_digits: int = 2
    b_digits: int = 3
    direct_low: float = 0.8
    direct_high: float = 0.2
    version: int = 1


def _check(spec: ToolArithmeticSpec) -> None:
    if not (1 <= spec.a_digits <= 6 and 1 <= spec.b_digits <= 6):
        raise ValueError(f"tool_arithmetic digits must be 1..6 (got a_digits={spec.a_digits}, b_digits={spec.b_digits})")
    if not (0.0 <= spec.direct_low <= 1.0 and 0.0 <= spec.direct_high <= 1.0):
        raise ValueError(f"tool_arithmetic direct_low/direct_high must be in [0, 1] (got {spec.direct_low}, {spec.direct_high})")


def problems(n: int, *, spec: ToolArithmeticSpec, seed: int) -> list[tuple[int, int]]:
    """`n` distinct (a, b) pairs, deterministic from `seed`."""
    _check(spec)
    lo_a, hi_a = 10 ** (spec.a_digits - 1) if spec.a_digits > 1 else 0, 10**spec.a_digits - 1
    lo_b, hi_b = 10 ** (spec.b_digits - 1) if spec.b_digits > 1 else 0, 10**spec.b_digits - 1
    total = (hi_a - lo_a + 1) * (hi_b - lo_b + 1)
    if n > total // 2:
        raise ValueError(f"asked for {n} distinct tool_arithmetic problems; at most {total // 2} are drawn from "
                         f"{total} with a_digits={spec.a_digits}, b_digits={spec.b_digits}; lower num_train/num_test")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < n:
        ab = (rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b))
        if ab not in seen:
            seen.add(ab)
            out.append(ab)
    return out


def calculator(expression: str) -> str:
    """The calculator tool: the value of an arithmetic expression (+ - * / and parentheses, no
    names or calls, via `rlframe.rewards.safe_eval`), an integer written without a decimal point;
    "error: ..." for anything else."""
    from rlframe.rewards.safe_eval import UnsafeExpression, evaluate_expression

    try:
        value = evaluate_expression(str(expression))
    except UnsafeExpression as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else repr(round(float(value), 6))


def question(a: int, b: int) -> str:
    return f"What is {a}*{b}?"


def prompt_messages(a: int, b: int) -> list[dict]:
    """System (tool documentation) and user messages of one problem."""
    return [{"role": "system", "content": tool_system_prompt([CALCULATOR], SYSTEM)},
            {"role": "user", "content": question(a, b)}]


def answer_text(value: int | str) -> str:
    return f"<answer>{value}</answer>"


def tool_rows(*, num_train: int, num_test: int, spec: ToolArithmeticSpec | None = None, seed: int = 0) -> dict[str, list[dict]]:
    """Disjoint train/test rows (verl layout) of the task."""
    spec = spec or ToolArithmeticSpec()
    pairs = problems(num_train + num_test, spec=spec, seed=seed)
    out: dict[str, list[dict]] = {"train": [], "test": []}
    for i, (a, b) in enumerate(pairs):
        split = "train" if i < num_train else "test"
        out[split].append({
            "prompt": prompt_messages(a, b),
            "data_source": DATA_SOURCE,
            "ability": "math",
            "reward_model": {"ground_truth": str(a * b), "style": "rule"},
            "extra_info": {"split": split, "index": len(out[split]), "a": a, "b": b, "expression": f"{a}*{b}"},
        })
    return out


def conversation(a: int, b: int, *, use_tool: bool) -> list[dict]:
    """A full transcript: with the tool (call, result, answer) or answering directly."""
    msgs = prompt_messages(a, b)
    if not use_tool:
        return msgs + [{"role": "assistant", "content": answer_text(a * b)}]
    call = format_tool_call("calculator", {"expression": f"{a}*{b}"})
    return msgs + [{"role": "assistant", "content": call}, {"role": "tool", "content": str(a * b)},
                   {"role": "assistant", "content": answer_text(a * b)}]


def sft_conversations(rows: list[dict], *, spec: ToolArithmeticSpec, seed: int) -> list[list[dict]]:
    """Pre-training transcripts of `rows`; which ones answer directly is drawn from `seed`."""
    rng = random.Random(seed + 1)
    lo, hi = (10 ** (spec.a_digits - 1) if spec.a_digits > 1 else 0), 10**spec.a_digits - 1
    middle = (lo + hi + 1) / 2
    out = []
    for r in rows:
        a, b = r["extra_info"]["a"], r["extra_info"]["b"]
        p_direct = spec.direct_low if a < middle else spec.direct_high
        out.append(conversation(a, b, use_tool=rng.random() >= p_direct))
    return out


def tokenizer_corpus(*, num: int = 2000, seed: int = 1234) -> list[str]:
    """Texts the BPE tokenizer is trained on: `num` transcripts of both kinds, one text per turn as
    the template writes it (role line, content), from their own problem stream (digits are single
    tokens, so no product is learned from it)."""
    texts = []
    for i, (a, b) in enumerate(problems(num, spec=ToolArithmeticSpec(), seed=seed)):
        for m in conversation(a, b, use_tool=i % 2 == 0):
            texts.append(f"user\n<tool_response>\n{m['content']}\n</tool_response>" if m["role"] == "tool"
                         else f"{m['role']}\n{m['content']}")
    return texts


def main(argv: list[str] | None = None) -> dict[str, Path]:
    from rlframe.data.synthetic import write_splits

    p = argparse.ArgumentParser(prog="python -m rlframe.data.tool_task", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
    p.add_argument("--num-train", type=int, default=5000)
    p.add_argument("--num-test", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = tool_rows(num_train=args.num_train, num_test=args.num_test, seed=args.seed)
    return write_splits(rows, args.out, task=DATA_SOURCE)


if __name__ == "__main__":
    main()
