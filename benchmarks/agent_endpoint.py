"""The OpenAI endpoint's overhead: the tool task's rollout through the endpoint (agent.mode=openai, the
worked example examples/openai_agent/environment.py) against the in-process agent loop, on the same
prompts and the same engine, and the requests per second the endpoint sustains.

    python benchmarks/agent_endpoint.py [--prompts 32] [--repeats 5] [--steps 8] [--rounds 2] [--no-write]

Training step: the worked example's GRPO training (examples/agent_tools/run.py's settings) with the
in-process loop and with agent.mode=openai (examples/openai_agent/environment.py), runs alternating;
seconds per step and of it generation, median (range).

Rollout alone: --prompts prompts of the tool task's held-out split, greedy (both paths produce the same
trajectories, so they do the same generation work), through the transformers engine on the
pre-trained agent preset in this process; the in-process loop (`AgentLoop.run`) and the endpoint path
(`OpenAIAgentLoop.run`: HTTP server, the official openai client, token-exact capture, the batch built
from the records) alternate, --repeats times each; seconds per rollout, median (range), and the
endpoint's against the loop's.

Requests per second: the same endpoint, its generate answering every request with one token at once
(no model), 128 episodes at once through run_episodes (one connection pool, as training) each
--turns turns long: what HTTP, JSON, rendering, encoding and capture cost per request.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import machine_line, machine_state, markdown_table, write_section  # noqa: E402

SECTION = "## Agents: the OpenAI endpoint's overhead"
AGENT = ["model.tiny_preset=agent", "data.task=tool_arithmetic", "agent.enabled=true", "data.prompt_length=128",
         "data.response_length=96", "agent.mode=openai",
         f"agent.environment={ROOT / 'examples/openai_agent/environment.py'}:episode"]


def _setup(prompts: int):
    import torch
    from transformers import AutoTokenizer

    from rlframe.config import load_config
    from rlframe.controller.trainers.agent_loop import build_agent_loop
    from rlframe.controller.trainers.openai_agent import OpenAIAgentLoop
    from rlframe.controller.trainers.prepare import build_data, model_path
    from rlframe.data.dataloader import collate, to_dataproto
    from rlframe.workers.rollout import RolloutConfig
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine

    cfg = load_config("grpo_tiny", AGENT + [f"data.val_size={prompts}"])
    path = model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path)
    _, val = build_data(cfg, tokenizer)
    rows = [val[i] for i in range(prompts)]
    batch = to_dataproto(collate(rows, list(range(prompts)), pad_token_id=tokenizer.pad_token_id))
    engine = HFRolloutEngine(path, config=RolloutConfig(backend="hf"))
    torch.set_num_threads(2)
    return cfg, tokenizer, batch, engine, build_agent_loop(cfg, tokenizer), OpenAIAgentLoop(cfg, tokenizer)


def rollout_rows(prompts: int, repeats: int) -> tuple[list[list], str]:
    from rlframe.workers.rollout import SamplingConfig

    cfg, tokenizer, batch, engine, loop, endpoint_loop = _setup(prompts)
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=cfg.data.response_length)

    def generate(gen_in, sampling):
        return engine.generate(gen_in, sampling), {}

    times = {"in-process loop": [], "OpenAI endpoint": []}
    same = True
    try:
        for _ in range(repeats + 1):  # the first round warms both up and is left out
            a0 = time.perf_counter()
            ref, _ = loop.run(batch, greedy, generate)
            a1 = time.perf_counter()
            got, metrics = endpoint_loop.run(batch, greedy, generate)
            a2 = time.perf_counter()
            times["in-process loop"].append(a1 - a0)
            times["OpenAI endpoint"].append(a2 - a1)
            same &= bool((ref.batch["responses"] == got.batch["responses"]).all())
        requests, calls = metrics["agent/requests"], metrics["agent/generate_calls"]
    finally:
        loop.close()
        endpoint_loop.close()
    base = statistics.median(times["in-process loop"][1:])
    rows = []
    for name, t in times.items():
        t = t[1:]
        rows.append([name, f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})",
                     f"{statistics.median(t) / base:.2f}x"])
    note = (f"{prompts} prompts, greedy: the endpoint path's trajectories are the loop's token for token "
            f"({'yes' if same else 'NO'}, every round); {requests:.0f} requests in {calls:.0f} generate calls per rollout")
    return rows, note


def requests_per_second(turns: int, episodes: int = 128) -> tuple[float, int]:
    """Requests per second through the endpoint, the way training sends them (run_episodes: one connection
    pool, `episodes` at once), with a generate that answers one end-of-turn token at once: each episode
    `turns` turns of the tool task's first prompt, a user message after each reply."""
    import torch
    from transformers import AutoTokenizer

    from rlframe.agents.environment import run_episodes
    from rlframe.agents.openai_endpoint import OpenAIEndpoint
    from rlframe.config import load_config
    from rlframe.controller.trainers.prepare import build_data, model_path
    from rlframe.protocol import DataProto

    cfg = load_config("grpo_tiny", AGENT[:5] + ["data.val_size=1"])
    tokenizer = AutoTokenizer.from_pretrained(model_path(cfg))
    messages = build_data(cfg, tokenizer)[1][0].raw_prompt
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)

    def generate(gen_in, sampling):
        b = len(gen_in)
        return DataProto.from_dict(tensors={"responses": torch.full((b, 1), eos), "response_mask": torch.ones(b, 1),
                                            "rollout_log_probs": torch.zeros(b, 1)}), {}

    async def episode(client, row):
        history = list(messages)
        for k in range(turns):
            reply = await client.chat.completions.create(model="policy", messages=history)
            history += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"go on {k}"}]
        return 1.0

    endpoint = OpenAIEndpoint(generate, tokenizer, model="policy", response_length=1 << 16).start()
    try:
        t0 = time.perf_counter()
        results = run_episodes(episode, [{}] * episodes, base_url=endpoint.base_url, token=endpoint.token,
                               concurrency=episodes, timeout_s=600)
        elapsed = time.perf_counter() - t0
    finally:
        endpoint.close()
    assert all(r.status == "ok" for r in results), [r.error for r in results if r.status != "ok"][:3]
    return episodes * turns / elapsed, episodes * turns


def training_rows(steps: int, rounds: int) -> tuple[list[list], str]:
    """The worked example's GRPO training (examples/agent_tools/run.py's settings: 32 prompts x 4 samples a
    step) with the in-process loop and through the endpoint, `rounds` runs each alternating; median step
    and generation seconds over the steps after the first of every run."""
    import tempfile

    from examples.agent_tools.run import run

    modes = {"in-process loop": ["agent.enabled=true"],
             "OpenAI endpoint": ["agent.enabled=true", "agent.mode=openai",
                                 f"agent.environment={ROOT / 'examples/openai_agent/environment.py'}:episode"]}
    steps_of = {name: [] for name in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, extra in modes.items():
                rows = run(name, steps=steps, out=Path(tmp) / str(r), overrides=extra)
                steps_of[name] += [row for row in rows if row["step"] >= 2]
    base = statistics.median(row["timing_s/step"] for row in steps_of["in-process loop"])
    table = []
    for name, rows in steps_of.items():
        step = [row["timing_s/step"] for row in rows]
        gen = [row["timing_s/gen"] for row in rows]
        table.append([name, f"{statistics.median(step):.2f} ({min(step):.2f}-{max(step):.2f})",
                      f"{statistics.median(gen):.2f} ({min(gen):.2f}-{max(gen):.2f})", f"{statistics.median(step) / base:.2f}x"])
    endpoint = steps_of["OpenAI endpoint"]
    note = (f"{rounds} runs of {steps} steps each, alternating, {len(endpoint)} steps each counted (the first of a run "
            f"left out); through the endpoint {statistics.median(r['agent/requests'] for r in endpoint):.0f} requests "
            f"in {statistics.median(r['agent/generate_calls'] for r in endpoint):.0f} generate calls per step (median)")
    return table, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="training steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="training runs per path")
    ap.add_argument("--turns", type=int, default=4, help="turns per episode for the request rate")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    before = machine_state()
    print(f"load {before['load1']:.2f}, fp32 matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    train, train_note = training_rows(args.steps, args.rounds)
    rows, note = rollout_rows(args.prompts, args.repeats)
    rate, total = requests_per_second(args.turns)
    after = machine_state()
    body = (f"{machine_line()} fp32 matmul {before['gflops']:.0f} GFLOP/s before, "
            f"{after['gflops']:.0f} after; 1-minute load average {before['load1']:.2f} before, {after['load1']:.2f} after.\n\n"
            f"Training step: the worked example (the tool task, GRPO, pre-trained agent preset, `python -m rlframe.main` "
            f"in the hybrid engine on vLLM); {train_note}.\n\n"
            + markdown_table(["path", "s per step, median (range)", "generation s per step", "vs in-process"], train)
            + f"\n\nRollout alone: transformers engine in this process (2 threads), the two paths alternating, "
              f"{args.repeats} rounds after a warm-up; {note}.\n\n"
            + markdown_table(["rollout path", "s per rollout, median (range)", "vs in-process"], rows)
            + f"\n\nRequests per second the endpoint sustains with an instant one-token generate: {rate:.0f} "
              f"({total} chat completions: 128 episodes at once through one connection pool, as training sends them, "
              f"{args.turns} turns each).")
    print(body)
    if not args.no_write:
        command = (f"python benchmarks/agent_endpoint.py --prompts {args.prompts} --repeats {args.repeats} "
                   f"--steps {args.steps} --rounds {args.rounds} --turns {args.turns}")
        write_section(SECTION, f"Reproduce: `{command}` (measured {time.strftime('%Y-%m-%d')}).\n\n{body}")


if __name__ == "__main__":
    main()
