"""The tool task (products of two numbers, a calculator to call) as an environment written against the
OpenAI API: what an agent harness built on the `openai` SDK looks like to rlframe (agent.mode=openai).

    python -m rlframe.main --config-name grpo_tiny model.tiny_preset=agent data.task=tool_arithmetic \
        agent.enabled=true agent.mode=openai agent.environment=examples/openai_agent/environment.py:episode \
        data.prompt_length=128 data.response_length=96

The row's messages already document the calculator in their system turn (the dataset's prompt); the
model answers with OpenAI tool calls, this file runs them and sends the results back as tool messages,
for at most three assistant turns, and the episode's reward is the task's verifier on the model's text.
"""

from __future__ import annotations

import json

import openai

from rlframe.agents.calculator import calculate
from rlframe.rewards.verifiers import tool_arithmetic_score

MAX_TURNS = 3


def run_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r} (tools: calculator)"
    try:
        return calculate(json.loads(arguments)["expression"])
    except Exception as err:  # a bad call is an observation for the model, not the episode's end
        return f"error: {type(err).__name__}: {err}"


async def episode(client: openai.AsyncOpenAI, row: dict) -> dict:
    messages, text, turns = list(row["prompt"]), "", 0
    while turns < MAX_TURNS:
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError as err:
            if err.code == "context_length_exceeded":  # the episode's tokens are spent
                break
            raise
        choice, turns = reply.choices[0], turns + 1
        text += choice.message.content or ""
        messages.append(choice.message.model_dump(exclude_none=True))
        if not choice.message.tool_calls or choice.finish_reason == "length":
            break
        messages += [{"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.name,
                                                                                   call.function.arguments)}
                     for call in choice.message.tool_calls]
    return {"reward": tool_arithmetic_score(text, row["ground_truth"]), "turns": turns}
