"""Greedy evaluation of a chat model on the tool task, on the RL trainer's own agent loop.

Used to document the pre-trained agent preset (docs/tiny_model.md) and by its tests. The prompts
run through `rlframe.controller.trainers.agent_loop.AgentLoop` with a transformers rollout engine
(`HFRolloutEngine`, greedy) and the built-in tools (`load_tools(None)`: the calculator) in the
sandboxed `ToolRunner`, exactly as an RL rollout with `agent.enabled` runs them:

    generate greedily until <|im_end|> (or the tokens left)
    if the turn holds a <tool_call> and turns are left: run the calls, append the tool turn
        (`agent_loop.tool_turn_text`) and generate the next assistant turn
    else: stop

The score is the verifier's (`tool_arithmetic_score`) on the policy's own text: its tokens
(response_mask), decoded without special tokens, tool turns left out, as the RL trainer scores a
rollout. `use_tools=False` runs the loop with `max_turns=1`: a turn with a call ends the trajectory,
the model gets no result and its text holds no answer.

Token budget: the loop bounds a trajectory's total tokens (`response_length`: every assistant turn
and the tool turns between them), not each turn. The default is `max_turns * max_new_tokens` plus,
between turns, `max_turns - 1` tool turns carrying a 5-digit result (the task's largest product;
18 tokens each with the agent preset's tokenizer): 3 * 48 + 2 * 18 = 180 with tools, 48 without.
A single turn may therefore run past `max_new_tokens` when the others are short.
"""

from __future__ import annotations

from dataclasses import dataclass

_RESULT_PLACEHOLDER = "99999"  # a tool result as wide as the task's largest product (99 * 999 = 98901)


@dataclass(frozen=True)
class AgentEvalResult:
    n: int
    accuracy: float  # verifier score 1
    tool_call_rate: float  # trajectories whose text holds a call
    accuracy_with_call: float  # among trajectories with a call
    accuracy_direct: float  # among trajectories without a call
    answered_rate: float  # trajectories whose text holds an <answer>


def default_response_length(tokenizer, *, max_turns: int, max_new_tokens: int) -> int:
    """The total token budget of a trajectory: `max_turns` turns of `max_new_tokens` and the
    `max_turns - 1` tool turns between them (module docstring)."""
    from rlframe.controller.trainers.agent_loop import tool_turn_text

    tool_turn = len(tokenizer.encode(tool_turn_text(tokenizer, [_RESULT_PLACEHOLDER]), add_special_tokens=False))
    return max_turns * max_new_tokens + (max_turns - 1) * tool_turn


def evaluate_agent(engine, rows: list[dict], *, use_tools: bool = True, max_turns: int = 3, max_new_tokens: int = 48,
                   response_length: int | None = None) -> AgentEvalResult:
    """Greedy accuracy of the rollout engine's model (an `HFRolloutEngine`) on tool-task rows
    (`rlframe.data.tool_task.tool_rows`). `response_length` is the total token budget of a
    trajectory; None: `default_response_length` (module docstring)."""
    from rlframe.agents.sandbox import ToolRunner
    from rlframe.agents.tools import load_tools
    from rlframe.controller.trainers.agent_loop import AgentLoop
    from rlframe.controller.trainers.phases import decode_responses
    from rlframe.protocol import DataProto
    from rlframe.rewards.verifiers import extract_tagged_answer, tool_arithmetic_score
    from rlframe.workers.rollout import SamplingConfig
    from rlframe.workers.rollout.batch import prompts_from_rows

    tok = engine.tokenizer
    turns = max_turns if use_tools else 1
    if response_length is None:
        response_length = default_response_length(tok, max_turns=turns, max_new_tokens=max_new_tokens)
    prompts = [tok.encode(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for r in rows]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = DataProto.from_dict(tensors=prompts_from_rows(prompts, pad_id=pad_id))
    sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=response_length)
    with ToolRunner(load_tools(None)) as runner:
        loop = AgentLoop(tok, runner, max_turns=turns, response_length=response_length)
        out, _ = loop.run(batch, sampling, lambda gen_in, s: (engine.generate(gen_in, s), {}))
    texts = decode_responses(tok, out)
    scores = [tool_arithmetic_score(t, r["reward_model"]["ground_truth"]) for t, r in zip(texts, rows)]
    called = ["<tool_call>" in t for t in texts]

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
    """Load an HF model directory in fp32 into an `HFRolloutEngine` and run `evaluate_agent`."""
    from rlframe.workers.rollout.config import RolloutConfig
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine

    engine = HFRolloutEngine(str(model_dir), config=RolloutConfig(backend="hf", dtype="float32"))
    return evaluate_agent(engine, rows, **kwargs)
