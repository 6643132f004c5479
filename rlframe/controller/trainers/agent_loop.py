"""Multi-turn rollouts with tools (agent.enabled): the policy generates a turn; when the turn holds
tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, rlframe/agents/calls.py),
they run in the sandboxed tool runner and their results come back as a tool turn of the chat
template; the policy generates again, until a turn without a call, `agent.max_turns` assistant
turns, or data.response_length tokens.

    active = every sample (n per prompt)
    while active:
        one batched generate call: each active sample's prompt + its tokens so far, n=1, up to the
            tokens it has left, ending at the template's end-of-turn token (EOS)
        turns without calls, at the turn limit or out of tokens end; the others get the tool turn
        (tokens the model never sampled) appended

Per sample the batch also records `agent_turns` (its assistant turns) and the non-tensor
`agent_tool_statuses` (each tool call's status, in order), which the generation dumps show.

Token bookkeeping, per sample, in one response row of data.response_length tokens:
  responses        the policy's turns and the tool turns between them, in order
  attention_mask   1 over all of them (the model sees the tool results as context)
  response_mask    1 on the policy's own tokens only: tool turns and template tokens are never
                   trained on, and are out of the KL and entropy terms, which use this mask
  rollout_log_probs the rollout engine's log-probs of the policy's tokens (0 on tool tokens)
The reward is the trajectory's: the verifier scores the policy's text (tool turns are not in it).

The loop is backend-agnostic: it only calls `generate(prompts, sampling)`, so it runs on vLLM and
on transformers, in the hybrid engine or against a generation group (split placement).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from rlframe.controller.preflight.checks import turns_append_only
from rlframe.controller.trainers.phases import add_generation_metrics
from rlframe.protocol import DataProto
from rlframe.workers.rollout import SamplingConfig
from rlframe.workers.rollout.affinity import ReplicaAffinity
from rlframe.workers.rollout.batch import assemble_batch, prompts_from_rows
from rlframe.workers.rollout.seeds import SEED_KEY, seeds_for
from rlframe.workers.rollout.stops import end_of_sequence_ids

Generate = Callable[[DataProto, SamplingConfig], tuple[DataProto, dict]]


@dataclass
class Trajectory:
    prompt: list[int]
    sample: int = 0  # its index in the call's batch (prompt b's samples are b*n .. b*n+n-1): seeds its turns
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: sampled by the policy, 0: a tool turn
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    done: bool = False
    truncated: bool = False  # ran out of tokens before its last turn ended
    tool_seconds: float = 0.0  # wall time its tool calls took, all turns
    statuses: list[str] = field(default_factory=list)  # each tool call's status (ok, error, ...), in order
    budget_spent: bool = False  # ended because tool_seconds reached agent.max_tool_seconds_per_trajectory


def tool_turn_text(tokenizer, results: list[str]) -> str:
    """The template text between the end of an assistant turn (its EOS) and the start of the next
    assistant turn, carrying `results` as tool messages: rendered by the tokenizer's own chat
    template, so a model sees the format it was trained on. A control token that a result spells out
    (`<|im_end|>` in a tool's output, or in an unknown tool's name echoed back) stays text: it is
    broken up first (rlframe.agents.calls.neutralize_control_tokens), so that encoding the turn never
    yields a control token the template did not write."""
    from rlframe.agents.calls import control_token_texts, neutralize_control_tokens

    controls = control_token_texts(tokenizer)
    tool_messages = [{"role": "tool", "content": neutralize_control_tokens(r, controls)} for r in results]
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + tool_messages, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the tokenizer's chat template renders a conversation differently once a tool turn is added "
                         "(the earlier turns must be a prefix); multi-turn rollouts need an append-only template")
    eos = tokenizer.eos_token
    end = before.rfind(eos)
    if eos is None or end < 0:
        raise ValueError(f"the chat template does not end an assistant turn with the EOS token {eos!r}; set the "
                         "tokenizer's eos_token to the template's end-of-turn token")
    return before[end + len(eos):] + after[len(before):]


class AgentLoop:
    """Runs trajectories for a batch of prompts; `run` returns the contract rollout batch (samples
    of a prompt adjacent) with the metrics of the loop."""

    def __init__(self, tokenizer, runner, *, max_turns: int, response_length: int, max_calls_per_turn: int | None = None,
                 max_tool_seconds: float | None = None):
        from functools import partial

        from rlframe.agents.calls import parse_tool_calls

        self.tokenizer, self.runner = tokenizer, runner
        self.parse = partial(parse_tool_calls, max_calls=max_calls_per_turn) if max_calls_per_turn else parse_tool_calls
        self.max_turns, self.response_length, self.max_tool_seconds = max_turns, response_length, max_tool_seconds
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_ids = end_of_sequence_ids(tokenizer)  # every id a turn may end with (rollout/stops.py)
        self.turn_checks: list | None = None  # preflight: a list to which each run adds its append-only check
        tool_turn_text(tokenizer, ["0"])  # the template's errors surface before any generation

    def run(self, prompts: DataProto, sampling: SamplingConfig, generate: Generate, *,
            replicas: int = 1) -> tuple[DataProto, dict]:
        """`replicas`: the generation replicas `generate` spreads a call over; a trajectory's turns go to the
        replica of its first (rlframe/workers/rollout/affinity.py)."""
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        n = sampling.n
        trajs = [Trajectory(prompt=ids[i][mask[i].bool()].tolist(), sample=i * n + j)
                 for i in range(len(prompts)) for j in range(n)]
        statuses: Counter = Counter()
        metrics: dict[str, float] = {}
        turn = 0
        snapshots = [[] for _ in trajs]  # preflight: each trajectory's tokens after every turn
        affinity = ReplicaAffinity()
        while active := [t for t in trajs if not t.done]:
            turn += 1
            active = [active[i] for i in affinity.order([t.sample for t in active], replicas)]
            self._generate_turn(active, sampling, generate, seed_salt=turn, metrics=metrics)
            pending = [(t, calls) for t in active if (calls := self._calls_to_run(t))]
            if pending:
                results = self.runner.run([c for _, calls in pending for c in calls])
                statuses.update(r.status for r in results)
                k = 0
                for t, calls in pending:
                    done = results[k:k + len(calls)]
                    t.statuses += [r.status for r in done]
                    self._append_tool_turn(t, [r.text for r in done], seconds=sum(r.seconds for r in done))
                    k += len(calls)
            if self.turn_checks is not None:
                for snap, t in zip(snapshots, trajs):
                    snap.append(list(t.tokens))
        metrics["agent/replica_moved_turns"] = float(affinity.moved)
        batch = self._batch(prompts, trajs, n)
        if self.turn_checks is not None:
            self.turn_checks.append(turns_append_only(snapshots, _response_rows(batch)))
        return batch, {**metrics, **self._metrics(trajs, statuses)}

    def _generate_turn(self, active: list[Trajectory], sampling: SamplingConfig, generate: Generate, *,
                       seed_salt: int, metrics: dict) -> None:
        rows = [t.prompt + t.tokens for t in active]
        room = max(self.response_length - len(t.tokens) for t in active)
        gen_in = DataProto.from_dict(tensors=prompts_from_rows(rows, pad_id=self.pad_id))
        if sampling.seed is not None:  # each turn's seed: the call's seed, the sample, the turn (not the row)
            gen_in.batch[SEED_KEY] = seeds_for([(sampling.seed, t.sample, seed_salt) for t in active])
        out, gen_m = generate(gen_in, dataclasses.replace(sampling, n=1, max_new_tokens=room))
        add_generation_metrics(metrics, gen_m)
        resp, rmask, lps = out.batch["responses"], out.batch["response_mask"].bool(), out.batch["rollout_log_probs"]
        for i, t in enumerate(active):
            left = self.response_length - len(t.tokens)
            toks, lp = resp[i][rmask[i]].tolist()[:left], lps[i][rmask[i]].tolist()[:left]
            t.tokens += toks
            t.mask += [1] * len(toks)
            t.log_probs += lp
            t.turns += 1
            ended = bool(toks) and toks[-1] in self.eos_ids  # else it ran out of tokens mid-turn
            t.done = t.truncated = not ended

    def _calls_to_run(self, t: Trajectory) -> list:
        """The tool calls of the turn `t` just ended, when the loop continues for it; else marks it done."""
        if t.done:
            return []
        calls = self.parse(self.tokenizer.decode(t.tokens[_last_zero(t.mask):], skip_special_tokens=False))
        if not calls or t.turns >= self.max_turns:
            t.done = True
            return []
        return calls

    def _append_tool_turn(self, t: Trajectory, results: list[str], *, seconds: float = 0.0) -> None:
        """Append the tool turn of `results` (the texts of calls that took `seconds` together). The
        trajectory ends here instead when its tools' time reaches `max_tool_seconds`
        (agent.max_tool_seconds_per_trajectory; None: no budget), as at max_turns: the turn whose calls
        spent it is its last (a trajectory may exceed the budget by that turn's calls), no later call
        of it runs, and `agent/tool_budget_ended_frac` counts it."""
        t.calls += len(results)
        t.tool_seconds += seconds
        if self.max_tool_seconds is not None and t.tool_seconds >= self.max_tool_seconds:
            t.done = t.budget_spent = True
            return
        obs = self.tokenizer.encode(tool_turn_text(self.tokenizer, results), add_special_tokens=False)
        if len(t.tokens) + len(obs) >= self.response_length:  # no room left to answer after the results
            t.done = t.truncated = True
            return
        t.tokens += obs
        t.mask += [0] * len(obs)
        t.log_probs += [0.0] * len(obs)

    def _batch(self, prompts: DataProto, trajs: list[Trajectory], n: int) -> DataProto:
        from rlframe.workers.rollout.batch import left_pad

        ids, pmask = left_pad([t.prompt for t in trajs[::n]], pad_id=self.pad_id, width=prompts.batch["input_ids"].shape[1])
        tensors = assemble_batch(prompt_ids=ids, prompt_mask=pmask, responses=[t.tokens for t in trajs],
                                 log_probs=[t.log_probs for t in trajs], n=n, response_length=self.response_length,
                                 pad_token_id=self.pad_id)
        policy = torch.zeros_like(tensors["response_mask"])
        for i, t in enumerate(trajs):
            policy[i, :len(t.mask)] = torch.as_tensor(t.mask, dtype=policy.dtype)
        tensors["response_mask"] = policy  # attention_mask keeps the tool turns: context, not trained
        tensors["agent_turns"] = torch.tensor([t.turns for t in trajs], dtype=torch.long)
        out = prompts.select(batch_keys=[], non_tensor_keys=prompts.non_tensor_keys).repeat(n)
        return out.union(DataProto.from_dict(tensors=tensors,
                                             non_tensors={"agent_tool_statuses": [list(t.statuses) for t in trajs]}))

    def close(self) -> None:
        self.runner.close()

    def _metrics(self, trajs: list[Trajectory], statuses: Counter) -> dict[str, float]:
        calls = sum(statuses.values())
        m = {"agent/turns_mean": float(np.mean([t.turns for t in trajs])),
             "agent/turns_max": float(max(t.turns for t in trajs)),
             "agent/tool_calls_mean": float(np.mean([t.calls for t in trajs])),
             "agent/tool_call_rate": float(np.mean([t.calls > 0 for t in trajs])),
             "agent/tool_success_rate": statuses["ok"] / calls if calls else 0.0,
             "agent/truncated_frac": float(np.mean([t.truncated for t in trajs])),
             "agent/tool_budget_ended_frac": float(np.mean([t.budget_spent for t in trajs])),
             "agent/tool_tokens_mean": float(np.mean([len(t.mask) - sum(t.mask) for t in trajs]))}
        m.update({f"agent/calls_{status}": float(count) for status, count in statuses.items()})
        return m


def _response_rows(batch: DataProto) -> list[list[int]]:
    """Each row's response tokens as the batch holds them (policy and tool turns: attention 1)."""
    resp = batch.batch["responses"]
    att = batch.batch["attention_mask"][:, -resp.shape[1]:].bool()
    return [r[a].tolist() for r, a in zip(resp, att)]


def _last_zero(mask: list[int]) -> int:
    """Index just past the last tool token (0 when there is none): where the latest policy turn starts."""
    for i in range(len(mask) - 1, -1, -1):
        if mask[i] == 0:
            return i + 1
    return 0


def build_agent_loop(cfg, tokenizer) -> AgentLoop:
    """The run's agent loop: its tools loaded and checked (agent.tools_path, agent.builtin_tools), their
    sandboxed runner started, and its caps set: agent.max_calls_per_turn (the calls past it in a turn
    are answered with an error, status too_many_calls) and agent.max_tool_seconds_per_trajectory."""
    from rlframe.agents.calls import check_neutralized
    from rlframe.agents.sandbox import ToolRunner
    from rlframe.agents.tools import check_tool_budget, load_tools

    agent = cfg.agent
    tools = load_tools(agent.tools_path, builtin=tuple(agent.builtin_tools))
    check_tool_budget(tools, agent.max_tool_seconds_per_trajectory)  # validate.py checks it before Ray too
    check_neutralized(tokenizer)
    runner = ToolRunner(tools, max_result_chars=agent.max_result_chars)
    return AgentLoop(tokenizer, runner, max_turns=agent.max_turns, response_length=cfg.data.response_length,
                     max_calls_per_turn=agent.max_calls_per_turn, max_tool_seconds=agent.max_tool_seconds_per_trajectory)


def build_agent(cfg, tokenizer):
    """The run's rollout with an agent (agent.enabled): the in-process loop with tools (agent.mode=tools), or
    the user's environment through the OpenAI-compatible endpoint (agent.mode=openai: openai_agent.py)."""
    if cfg.agent.mode == "openai":
        from rlframe.controller.trainers.openai_agent import OpenAIAgentLoop

        return OpenAIAgentLoop(cfg, tokenizer)
    return build_agent_loop(cfg, tokenizer)
