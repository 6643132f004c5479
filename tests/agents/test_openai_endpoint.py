"""The OpenAI-compatible endpoint (rlframe/agents/openai_endpoint.py) over a real rollout engine
(transformers, the pre-trained agent preset), driven by the official `openai` client:
- greedy episodes of the tool task written against the OpenAI API (function calling: tools in,
  tool_calls out, tool messages back) give the in-process agent loop's trajectories token for token;
- 32 sampled episodes at once: every turn recorded once, exactly as sampled (the client's log-probs'
  token ids), the environment's turns exactly the loop's tool-turn tokens, batched generation;
- bad requests get OpenAI-style errors; misbehaving environments are scored 0 and counted.
"""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from rlframe.agents.environment import episode_metrics, run_episodes
from rlframe.agents.openai_endpoint import EndpointLimits, OpenAIEndpoint
from rlframe.controller.trainers.agent_loop import tool_turn_text
from rlframe.workers.rollout import SamplingConfig
from tests.agent_task import agent_task

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                               "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                              "required": ["expression"]}}}


@pytest.fixture(scope="module")
def setup():
    from rlframe.workers.rollout import RolloutConfig
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine

    cfg, path, tokenizer, val, loop = agent_task()
    engine = HFRolloutEngine(path, config=RolloutConfig(backend="hf"))

    def generate(gen_in, sampling):
        return engine.generate(gen_in, sampling), {}

    endpoint = OpenAIEndpoint(generate, tokenizer, model="policy", response_length=cfg.data.response_length,
                              limits=EndpointLimits(max_request_bytes=64 << 10)).start()
    yield cfg, tokenizer, val, loop, generate, endpoint
    endpoint.close()
    loop.runner.close()


def tool_environment(loop, *, temperature: float, max_turns: int, seed=None):
    """The tool task against the OpenAI API: the row's own messages (its system turn documents the
    calculator), the model's tool_calls run by the same sandboxed runner the in-process loop uses, their
    results sent back as tool messages, until a turn without calls, `max_turns` turns or the budget."""
    from rlframe.agents.calls import ToolCall
    from rlframe.rewards.verifiers import tool_arithmetic_score

    async def episode(client, row):
        messages, text, turns = list(row.raw_prompt), "", 0
        while True:
            try:
                reply = await client.chat.completions.create(model="policy", messages=messages, temperature=temperature,
                                                             seed=seed, logprobs=True)
            except openai.BadRequestError as err:  # the episode's response budget is spent
                assert err.code == "context_length_exceeded", err
                break
            msg, turns = reply.choices[0].message, turns + 1
            text += msg.content or ""
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls or turns >= max_turns or reply.choices[0].finish_reason == "length":
                break
            calls = [ToolCall(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
            results = await asyncio.to_thread(loop.runner.run, calls)
            messages += [{"role": "tool", "tool_call_id": c.id, "content": r.text}
                         for c, r in zip(msg.tool_calls, results)]
        return {"reward": tool_arithmetic_score(text, row.ground_truth), "turns": turns}

    return episode


def _recording(generate, calls: list):
    """`generate`, keeping each call's rows (their prompt tokens) in the order the call cuts them over replicas."""
    def gen(gen_in, sampling):
        ids, mask = gen_in.batch["input_ids"], gen_in.batch["attention_mask"]
        calls.append([ids[i][mask[i].bool()].tolist() for i in range(len(gen_in))])
        return generate(gen_in, sampling)
    return gen


def _replica_moves(calls: list, sequences: list[list[int]], replicas: int) -> tuple[int, int, int]:
    """(later turns on their conversation's earlier replica, later turns elsewhere, later turns moved
    although their replica had room): each recorded row is the one conversation whose final tokens it
    begins; row k of an n-row call runs on replica k // ceil(n / replicas). Whatever the calls' sizes
    (the endpoint's batches depend on when requests arrive), a turn may move only when its replica's
    share of the call is full of turns that stayed there."""
    last: dict[int, int] = {}
    kept = moved = moved_with_room = 0
    for rows in calls:
        per = -(-len(rows) // replicas)
        homes = []
        for k, row in enumerate(rows):
            (j,) = [j for j, seq in enumerate(sequences) if seq[:len(row)] == row]
            homes.append((k // per, last.get(j)))
            last[j] = k // per
        stayed = [sum(1 for r, home in homes if r == home == c) for c in range(replicas)]
        share = [sum(1 for r, _ in homes if r == c) for c in range(replicas)]
        for r, home in homes:
            if home is not None:
                kept, moved = kept + (r == home), moved + (r != home)
                moved_with_room += r != home and stayed[home] < share[home]
    return kept, moved, moved_with_room


def test_greedy_episodes_equal_the_in_process_agent_loop(setup):
    """Temperature 0: each episode's record (prompt, tokens, mask, log-probs) is the agent loop's
    trajectory of the same row, token for token. Both spread their calls over 2 replicas: a conversation's
    later turns go to the replica of its earlier ones (as the calls' cuts show), the rest counted as moved."""
    cfg, tokenizer, val, loop, generate, endpoint = setup
    rows = [val[i] for i in range(8)]
    from rlframe.protocol import DataProto
    from rlframe.workers.rollout.batch import prompts_from_rows

    prompts = DataProto.from_dict(tensors=prompts_from_rows([r.prompt_ids for r in rows], pad_id=tokenizer.pad_token_id))
    loop_calls, endpoint_calls = [], []
    batch, metrics = loop.run(prompts, SamplingConfig(n=1, temperature=0.0, max_new_tokens=cfg.data.response_length),
                              _recording(generate, loop_calls), replicas=2)
    endpoint.batcher.generate, endpoint.batcher.replicas = _recording(generate, endpoint_calls), 2
    try:
        results = run_episodes(tool_environment(loop, temperature=0.0, max_turns=cfg.agent.max_turns), rows,
                               base_url=endpoint.base_url, token=endpoint.token, concurrency=8, timeout_s=120)
    finally:
        endpoint.batcher.generate, endpoint.batcher.replicas = generate, 1
    assert [r.status for r in results] == ["ok"] * 8, [(r.status, r.error) for r in results]
    episodes = endpoint.store.pop_all()
    resp, mask = batch.batch["responses"], batch.batch["response_mask"]
    att = batch.batch["attention_mask"][:, -resp.shape[1]:].bool()
    for i, (row, res) in enumerate(zip(rows, results)):
        ep = episodes[res.id]
        assert ep.prompt == row.prompt_ids  # the row's messages render to the dataset's prompt tokens
        assert ep.tokens == resp[i][att[i]].tolist(), (i, tokenizer.decode(ep.tokens), tokenizer.decode(resp[i][att[i]]))
        assert ep.mask == mask[i][att[i]].tolist()
        assert ep.log_probs == pytest.approx(batch.batch["rollout_log_probs"][i][att[i]].tolist(), abs=1e-5)
        assert ep.turns == int(batch.batch["agent_turns"][i])
    assert sum(ep.turns for ep in episodes.values()) > len(rows)  # tools were called: multi-turn episodes
    sequences = [episodes[r.id].prompt + episodes[r.id].tokens for r in results]
    later_turns = sum(ep.turns - 1 for ep in episodes.values())
    for calls, affinity_moved in ((loop_calls, metrics["agent/replica_moved_turns"]),
                                  (endpoint_calls, endpoint.batcher.affinity.moved)):
        kept, moved, moved_with_room = _replica_moves(calls, sequences, replicas=2)
        assert kept + moved == later_turns and moved == affinity_moved and moved_with_room == 0, \
            (kept, moved, moved_with_room, affinity_moved)
    # the loop's calls hold every open conversation of a turn (no timing): its later turns mostly stay
    assert _replica_moves(loop_calls, sequences, replicas=2)[0] >= 1


def test_concurrent_sampled_episodes_are_recorded_exactly(setup):
    """32 episodes at once at temperature 0.8: each turn's sampled tokens are what the client was told
    (log-prob token ids), each environment turn is the loop's tool-turn tokens for those results, the
    log-probs are the engine's; the endpoint batched the requests."""
    cfg, tokenizer, val, loop, generate, endpoint = setup
    rows = [val[i % len(val)] for i in range(32)]
    seen: dict[str, list] = {}

    base = tool_environment(loop, temperature=0.8, max_turns=3)

    async def episode(client, row):  # the same, keeping what each reply said it sampled
        original = client.chat.completions.create

        async def create(**kw):
            reply = await original(**kw)
            seen.setdefault(client.default_headers["X-Episode-Id"], []).append(
                ([e.token_id for e in reply.choices[0].logprobs.content], [e.logprob for e in reply.choices[0].logprobs.content],
                 reply.choices[0].message))
            return reply

        client.chat.completions.create = create
        return await base(client, row)

    calls_before = endpoint.batcher.calls
    results = run_episodes(episode, rows, base_url=endpoint.base_url, token=endpoint.token, concurrency=32, timeout_s=120)
    assert [r.status for r in results] == ["ok"] * 32, [(r.status, r.error) for r in results]
    episodes = endpoint.store.pop_all()
    requests = sum(len(v) for v in seen.values())
    assert endpoint.batcher.calls - calls_before < requests / 4  # concurrent turns shared generate calls
    multi = 0
    for res in results:
        ep, turns = episodes[res.id], seen[res.id]
        k = 0
        for t, (ids, lps, msg) in enumerate(turns):
            assert ep.tokens[k:k + len(ids)] == ids and ep.mask[k:k + len(ids)] == [1] * len(ids)
            assert ep.log_probs[k:k + len(ids)] == pytest.approx(lps)
            k += len(ids)
            if t + 1 < len(turns):  # the environment's turn: the template's tool turn of the results, encoded once
                from rlframe.agents.calls import ToolCall

                results_text = [r.text for r in loop.runner.run(
                    [ToolCall(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls])]
                env = tokenizer.encode(tool_turn_text(tokenizer, results_text), add_special_tokens=False)
                assert ep.tokens[k:k + len(env)] == env and ep.mask[k:k + len(env)] == [0] * len(env)
                k += len(env)
                multi += 1
        assert k == len(ep.tokens)
    assert multi > 0
    metrics = episode_metrics(results)
    assert metrics["agent/env_ok_frac"] == 1.0 and "agent/env/turns" in metrics


def test_bad_requests_get_openai_errors(setup):
    cfg, tokenizer, val, loop, generate, endpoint = setup
    messages = list(val[0].raw_prompt)
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.token, max_retries=0,
                           default_headers={"X-Episode-Id": "bad-0"})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=endpoint.base_url, api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == ["policy"]
    cases = [({"n": 2}, "n"), ({"stream": True}, "stream"), ({"temperature": 3.0}, "temperature"),
             ({"stop": ["x"]}, "stop"), ({"max_tokens": 0}, "max_tokens"), ({"tool_choice": "required"}, "tool_choice")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="policy", messages=messages, **extra)
        assert err.value.body["param"] == param, (extra, err.value.body)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=messages)
    with pytest.raises(openai.APIStatusError) as err:  # 413: over max_request_bytes
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x" * (70 << 10)}])
    assert err.value.status_code == 413
    reply = client.chat.completions.create(model="policy", messages=messages, temperature=0, max_tokens=4)
    changed = [{**messages[0], "content": "another system prompt"}] + messages[1:]
    with pytest.raises(openai.BadRequestError) as err:  # a changed history cannot continue the episode
        client.chat.completions.create(model="policy", messages=changed + [reply.choices[0].message.model_dump(
            exclude_none=True), {"role": "user", "content": "go on"}])
    assert err.value.code == "history_mismatch" and "messages[0]" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:  # an assistant turn the model did not write
        client.chat.completions.create(model="policy", messages=messages + [
            reply.choices[0].message.model_dump(exclude_none=True), {"role": "assistant", "content": "42"}])
    assert err.value.code == "foreign_assistant_turn"
    endpoint.store.pop_all()
    with pytest.raises(openai.APIStatusError) as err:  # the episode was taken for training
        client.chat.completions.create(model="policy", messages=messages)
    assert err.value.status_code == 410
    endpoint.plan(temperature=1.0, top_p=1.0, top_k=-1, seeds={"ep-a": (1, 0)})  # a training rollout's episodes
    try:
        with pytest.raises(openai.APIStatusError) as err:  # one of an earlier rollout (given up on) is refused
            client.chat.completions.create(model="policy", messages=messages)
        assert err.value.status_code == 409 and err.value.code == "episode_not_in_rollout"
    finally:
        endpoint.plan(temperature=1.0, top_p=1.0, top_k=-1, seeds={})
        endpoint.fixed = None


def test_misbehaving_environments_are_scored_zero_and_counted(setup):
    """A hanging episode times out, a raising one is an error, a bad return is counted as such; one that
    blocks its event loop is given up on after the deadline and its grace, while it still blocks."""
    cfg, tokenizer, val, loop, generate, endpoint = setup
    release = threading.Event()

    async def episode(client, row):
        kind = row["kind"]
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "block":  # blocks its event loop until the test releases it, after run_episodes returned
            release.wait(600)
        if kind == "raise":
            raise RuntimeError("environment bug")
        if kind == "bad":
            return "not a number"
        return 1.0

    rows = [{"kind": k} for k in ("ok", "hang", "raise", "bad")]
    results = run_episodes(episode, rows, base_url=endpoint.base_url, token=endpoint.token, concurrency=4, timeout_s=2)
    assert [r.status for r in results] == ["ok", "timeout", "error", "bad_return"]
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0] and "environment bug" in results[2].error
    try:
        results = run_episodes(episode, [{"kind": "block"}], base_url=endpoint.base_url, token=endpoint.token,
                               concurrency=1, timeout_s=1, grace_s=1)
        assert not release.is_set()  # returned while the episode still blocked its loop
    finally:
        release.set()
    assert results[0].status == "timeout" and results[0].reward == 0.0


def test_a_batch_closes_when_the_last_other_episode_ends_without_a_request(setup):
    """Training's rule (a batch closes once every unfinished episode waits for a reply) also fires when the
    last change is an episode ending rather than a request arriving: with a 60 s lull window the waiting
    request would otherwise outlive its episode's 20 s."""
    from rlframe.agents.environment import Running

    cfg, tokenizer, val, loop, generate, endpoint = setup
    messages = list(val[0].raw_prompt)

    async def episode(client, row):
        if row == "quit":
            await asyncio.sleep(0.3)  # ends after the other's request is queued, sending none
            return 1.0
        await client.chat.completions.create(model="policy", messages=messages, temperature=0, max_tokens=2)
        return 1.0

    batcher = endpoint.batcher
    running = Running(on_finish=batcher.wake)
    saved = batcher.ready, batcher.window_s, batcher.max_wait_s
    batcher.ready, batcher.window_s, batcher.max_wait_s = (lambda waiting: waiting >= running.count), 60.0, 60.0
    try:
        results = run_episodes(episode, ["ask", "quit"], base_url=endpoint.base_url, token=endpoint.token,
                               concurrency=0, timeout_s=20, running=running)
    finally:
        batcher.ready, batcher.window_s, batcher.max_wait_s = saved
    endpoint.store.pop_all()
    assert [r.status for r in results] == ["ok", "ok"], [(r.status, r.error) for r in results]
