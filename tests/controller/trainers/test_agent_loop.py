"""The multi-turn agent loop on the pre-trained agent preset (BPE tokenizer, chat template, calculator
tool), with real rollout engines and the sandboxed tool runner:
- greedy trajectories are the same on vLLM and transformers;
- the response mask is 0 on exactly the tool turns' tokens (checked token by token against the
  template's rendering of the results) and 1 on every token the policy sampled;
- sampled trajectories repeat under the same seed.
And a GRPO run with agent.enabled trains end to end on real Ray/FSDP/vLLM."""

import json
from pathlib import Path

import pytest
import torch

from rlframe.controller.trainers import phases
from rlframe.controller.trainers.agent_loop import build_agent_loop, tool_turn_text
from rlframe.controller.trainers.validation import validation_prompts
from tests.agent_task import AGENT, agent_task
from tests.controller.trainers.test_end_to_end import run



class _Trainer:  # what validation_prompts reads of a trainer
    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer


@pytest.fixture(scope="module")
def setup():
    cfg, path, tokenizer, val, loop = agent_task()
    prompts = validation_prompts(_Trainer(cfg, tokenizer), val).index(torch.arange(8))
    yield cfg, path, tokenizer, prompts, loop
    loop.runner.close()


def _engine(backend, path):
    from rlframe.workers.rollout import RolloutConfig
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine

    if backend == "hf":
        return HFRolloutEngine(path, config=RolloutConfig(backend="hf"))
    from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(path, config=RolloutConfig(backend="vllm", max_model_len=256, kv_cache_bytes=32 << 20))


def _run(loop, engine, prompts, sampling):
    return loop.run(prompts, sampling, lambda gen_in, s: (engine.generate(gen_in, s), {}))


def _check_masks(batch, tokenizer, loop):
    """Token by token: the tool turns (attention 1, response mask 0) are exactly the template's
    rendering of the calculator's results, and carry no log-prob."""
    resp = batch.batch["responses"]
    att = batch.batch["attention_mask"][:, -resp.shape[1]:]
    mask, lps = batch.batch["response_mask"], batch.batch["rollout_log_probs"]
    checked = 0
    for i in range(len(resp)):
        real = att[i].bool()
        tokens, policy = resp[i][real].tolist(), mask[i][real].tolist()
        assert set(policy) <= {0, 1} and policy[0] == 1  # a trajectory starts with the policy's turn
        assert torch.all(lps[i][real][torch.tensor(policy) == 0] == 0)
        k = start = 0  # start: where the policy's current turn began
        while k < len(tokens):
            if policy[k]:
                k += 1
                continue
            end = k
            while end < len(tokens) and not policy[end]:
                end += 1
            results = loop.runner.run(loop.parse(tokenizer.decode(tokens[start:k], skip_special_tokens=False)))
            expected = tokenizer.encode(tool_turn_text(tokenizer, [r.text for r in results]), add_special_tokens=False)
            assert tokens[k:end] == expected, (i, tokenizer.decode(tokens[k:end]), tokenizer.decode(expected))
            checked += 1
            k = start = end
    return checked


def _check_per_sample_record(batch, metrics):
    """Each sample's turns and tool-call statuses (what the generation dumps show) add up to the
    loop's metrics."""
    turns, statuses = batch.batch["agent_turns"], batch.non_tensor_batch["agent_tool_statuses"]
    assert float(turns.float().mean()) == pytest.approx(metrics["agent/turns_mean"])
    assert sum(len(s) for s in statuses) / len(batch) == pytest.approx(metrics["agent/tool_calls_mean"])
    for status in {s for row in statuses for s in row}:
        assert sum(row.count(status) for row in statuses) == metrics[f"agent/calls_{status}"]


@pytest.mark.slow
@pytest.mark.vllm
def test_agent_loop_vllm_equals_transformers_and_masks_tool_turns(setup):
    cfg, path, tokenizer, prompts, loop = setup
    greedy = phases.sampling_for(cfg, n=1, temperature=0.0, seed=0)
    hf, vllm = _engine("hf", path), _engine("vllm", path)
    try:
        out_hf, m_hf = _run(loop, hf, prompts, greedy)
        out_v, m_v = _run(loop, vllm, prompts, greedy)
        for key in ("responses", "response_mask", "attention_mask"):
            assert torch.equal(out_hf.batch[key], out_v.batch[key]), key
        assert m_hf == m_v and m_v["agent/tool_call_rate"] > 0, m_v
        assert _check_masks(out_v, tokenizer, loop) > 0
        _check_per_sample_record(out_v, m_v)

        sampled = phases.sampling_for(cfg, n=2, temperature=1.0, seed=3)
        first, _ = _run(loop, vllm, prompts, sampled)
        again, _ = _run(loop, vllm, prompts, sampled)
        assert torch.equal(first.batch["responses"], again.batch["responses"])
        assert torch.equal(first.batch["rollout_log_probs"], again.batch["rollout_log_probs"])
        _check_masks(first, tokenizer, loop)
    finally:
        vllm.shutdown()


@pytest.mark.slow
def test_grpo_with_tools_trains(tmp_path, ray_cluster):
    """(agent.mode=openai runs end to end in the suite as its two preflight rows, GRPO with split placement and PPO on megatron: tests/controller/preflight/test_preflight.py.)"""
    _, summary = run("grpo_tiny", AGENT + ["data.train_batch_size=4", "trainer.val_every=2",
                                           "rollout.kv_cache_bytes=33554432"], tmp_path)
    rows = {r["step"]: r for r in map(json.loads, (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2):
        assert rows[step]["agent/turns_mean"] >= 1.0 and "agent/tool_call_rate" in rows[step]
    assert "val/agent/tool_call_rate" in rows[2] and "val/accuracy" in rows[2]


def test_a_turn_ending_in_any_end_id_of_the_generation_config_ends(setup, tmp_path):
    """A model whose generation config lists several end ids (Qwen, Llama 3): the engine stops at any
    of them, and the loop must take such a turn as ended, not as cut off mid-turn."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    cfg, path, tokenizer, prompts, _ = setup
    greedy = phases.sampling_for(cfg, n=1, temperature=0.0, seed=0)
    first = _engine("hf", path).generate(prompts, greedy).batch["responses"][:, 0]
    other = int(torch.mode(first).values)  # the commonest first token: made an end id below
    assert other != tokenizer.eos_token_id
    model = tmp_path / "two_end_ids"
    shutil.copytree(path, model)
    gen = GenerationConfig.from_pretrained(model)
    gen.eos_token_id = [tokenizer.eos_token_id, other]
    gen.save_pretrained(model)
    tok = AutoTokenizer.from_pretrained(model)
    loop = build_agent_loop(cfg, tok)
    try:
        rows = torch.nonzero(first == other).flatten()
        out, m = _run(loop, _engine("hf", str(model)), prompts.index(rows), greedy)
    finally:
        loop.runner.close()
    assert torch.all(out.batch["response_mask"].sum(-1) == 1)  # stopped at the second end id
    assert m["agent/truncated_frac"] == 0.0 and m["agent/turns_mean"] == 1.0, m
    _check_per_sample_record(out, m)
