"""Greedy multi-turn evaluation of a chat model on the tool task, with transformers and a local tool loop.

Used to document the pre-trained agent preset (docs/tiny_model.md) and by its tests. Per prompt:

    generate greedily until <|im_end|> (or `max_new_tokens` for the turn)
    if the turn holds a <tool_call> and tools are on and turns are left:
        run the calculator on its expression, append the tool turn (`chat_format.tool_turn_text`)
        and generate the next assistant turn
    else: stop

The score is the verifier's on the policy's own text (its turns, decoded without special tokens,
tool turns left out), as the RL trainer scores a rollout. With `use_tools=False` a turn with a call
ends the episode: the model gets no result and its text holds no answer. Prompts are grouped by
token length so that no padding is needed (positions as in training and in vLLM).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_calls(text: str) -> list[tuple[str, dict]]:
    """(name, arguments) of each well-formed call in `text`; malformed JSON is skipped."""
    out = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict):
            out.append((call["name"], call["arguments"]))
    return out


def run_tool(name: str, arguments: dict) -> str:
    from rlframe.data.tool_task import calculator

    if name != "calculator" or "expression" not in arguments:
        return f"error: unknown tool {name!r} or missing 'expression'"
    return calculator(arguments["expression"])


@dataclass
class Episode:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)  # the policy's own tokens (tool turns left out)
    calls: int = 0
    turns: int = 0
    turn_start: int = 0  # index in `tokens` where the latest assistant turn starts
    done: bool = False


@dataclass(frozen=True)
class AgentEvalResult:
    n: int
    accuracy: float  # verifier score 1
    tool_call_rate: float  # episodes with at least one call
    accuracy_with_call: float  # among episodes with a call
    accuracy_direct: float  # among episodes without a call
    answered_rate: float  # episodes whose text holds an <answer>


def _greedy_turn(model, tokenizer, episodes: list[Episode], max_new_tokens: int) -> None:
    import torch

    groups: dict[int, list[Episode]] = defaultdict(list)
    for e in episodes:
        groups[len(e.prompt) + len(e.tokens)].append(e)
    for length, members in sorted(groups.items()):
        ids = torch.tensor([e.prompt + e.tokens for e in members])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for e, row in zip(members, out[:, length:].tolist()):
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id) + 1]
            e.tokens += row
            e.policy += row
            e.turns += 1


def run_episodes(model, tokenizer, prompts: list[list[int]], *, use_tools: bool = True, max_turns: int = 3,
                 max_new_tokens: int = 48) -> list[Episode]:
    """Greedy episodes of `prompts` (token ids ending with the generation prompt)."""
    import torch

    from rlframe.data.chat_format import tool_turn_text

    episodes = [Episode(prompt=list(p)) for p in prompts]
    with torch.no_grad():
        while active := [e for e in episodes if not e.done]:
            _greedy_turn(model, tokenizer, active, max_new_tokens)
            for e in active:
                turn = e.tokens[e.turn_start:]
                calls = parse_calls(tokenizer.decode(turn, skip_special_tokens=False))
                ended = bool(turn) and turn[-1] == tokenizer.eos_token_id
                if not (use_tools and calls and ended and e.turns < max_turns):
                    e.done = True
                    continue
                e.calls += len(calls)
                e.tokens += tokenizer.encode(tool_turn_text([run_tool(*c) for c in calls]), add_special_tokens=False)
                e.turn_start = len(e.tokens)
    return episodes


def evaluate_agent(model, tokenizer, rows: list[dict], **kwargs) -> AgentEvalResult:
    """Greedy accuracy of `model` on tool-task rows (`rlframe.data.tool_task.tool_rows`)."""
    from rlframe.rewards.verifiers import extract_tagged_answer, tool_arithmetic_score

    prompts = [tokenizer.encode(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False) for r in rows]
    episodes = run_episodes(model, tokenizer, prompts, **kwargs)
    texts = [tokenizer.decode(e.policy, skip_special_tokens=True) for e in episodes]
    scores = [tool_arithmetic_score(t, r["reward_model"]["ground_truth"]) for t, r in zip(texts, rows)]
    called = [e.calls > 0 or "<tool_call>" in t for e, t in zip(episodes, texts)]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return AgentEvalResult(
        n=len(rows),
        accuracy=mean(scores),
        tool_call_rate=mean([float(c) for c in called]),
        accuracy_with_call=mean([s for s, c in zip(scores, called) if c]),
        accuracy_direct=mean([s for s, c in zip(scores, called) if not c]),
        answered_rate=mean([float(extract_tagged_answer(t) is not None) for t in texts]),
    )


def evaluate_agent_dir(model_dir, rows: list[dict], **kwargs) -> AgentEvalResult:
    """Load an HF model directory in fp32 and run `evaluate_agent`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return evaluate_agent(model, tok, rows, **kwargs)
