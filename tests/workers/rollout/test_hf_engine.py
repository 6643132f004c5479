"""transformers fallback engine against a plain greedy loop, plus its sampling and weight updates."""

from __future__ import annotations

import pytest
import torch

from rlframe.data.tiny_model import build_random_model
from rlframe.workers.rollout import RolloutConfig, SamplingConfig, build_rollout_engine, logprob_diff_metrics, response_log_probs
from rlframe.workers.rollout.hf_engine import HFRolloutEngine
from tests.workers.rollout.common import perturbed, prompt_batch


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(build_random_model(tmp_path_factory.mktemp("model"), preset="test", seed=0))


@pytest.fixture(scope="module")
def engine(model_path):
    return HFRolloutEngine(model_path, config=RolloutConfig(backend="hf"))


@torch.no_grad()
def _greedy_reference(model, prompt: list[int], steps: int, stop: set[int]) -> list[int]:
    """Argmax decoding of one unpadded prompt, recomputing the whole sequence each step (no cache)."""
    ids, out = list(prompt), []
    for _ in range(steps):
        nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt in stop:
            break
    return out


def test_greedy_matches_plain_loop_with_left_padding(engine):
    prompts = prompt_batch(engine.tokenizer, 6)
    out = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=10)).batch
    for i in range(6):
        prompt = prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist()
        ref = _greedy_reference(engine.model, prompt, 10, {engine.tokenizer.eos_token_id})
        k = int(out["response_mask"][i].sum())
        assert out["responses"][i, :k].tolist() == ref
        assert (out["responses"][i, k:] == engine.pad_token_id).all()


def test_log_probs_processed_and_raw(model_path, engine):
    prompts = prompt_batch(engine.tokenizer, 4)
    sampling = SamplingConfig(n=2, temperature=0.7, max_new_tokens=8, seed=0)
    out = engine.generate(prompts, sampling).batch
    ref = response_log_probs(engine.model, out, temperature=0.7)
    assert logprob_diff_metrics(out["rollout_log_probs"], ref, out["response_mask"])["rollout/logprob_diff_max"] < 1e-4
    raw = HFRolloutEngine(model_path, config=RolloutConfig(backend="hf", logprobs_mode="raw"), model=engine.model)
    out = raw.generate(prompts, sampling).batch
    ref = response_log_probs(engine.model, out, temperature=1.0)
    assert logprob_diff_metrics(out["rollout_log_probs"], ref, out["response_mask"])["rollout/logprob_diff_max"] < 1e-4


def test_seeded_sampling_groups_and_stop_strings(engine):
    prompts = prompt_batch(engine.tokenizer, 3)
    s = SamplingConfig(n=4, temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=12, seed=5)
    a, b = engine.generate(prompts, s).batch, engine.generate(prompts, s).batch
    assert torch.equal(a["responses"], b["responses"]) and a["responses"].shape == (12, 12)
    assert torch.equal(a["prompts"][4:8], prompts["input_ids"][1:2].expand(4, -1))
    stop = engine.tokenizer.decode([int(a["responses"][0, 2])])
    c = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=12,
                                                seed=5, stop=(stop,))).batch
    k = int(c["response_mask"][0].sum())
    assert k <= 3 and engine.tokenizer.decode(c["responses"][0, :k].tolist()).endswith(stop)
    assert (c["response_mask"][:, :k].sum() > 0) and torch.equal(c["responses"][0, :k], a["responses"][0, :k])


def test_update_weights_changes_the_model(engine):
    original = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    prompts = prompt_batch(engine.tokenizer, 4)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = engine.generate(prompts, greedy).batch["responses"]
    try:
        new = perturbed(original, seed=2, scale=0.5)
        stats = engine.update_weights(new)
        assert stats.num_params == len(original)
        assert all(torch.equal(p, new[n]) for n, p in engine.model.named_parameters())
        assert not torch.equal(engine.generate(prompts, greedy).batch["responses"], before)
    finally:
        engine.update_weights(original)


def test_backend_choice_and_config_errors(model_path):
    assert build_rollout_engine(model_path, config=RolloutConfig(backend="hf")).backend == "hf"
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        HFRolloutEngine(model_path, config=RolloutConfig(backend="hf", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="rollout.backend='sglang'"):
        RolloutConfig(backend="sglang")
    with pytest.raises(ValueError, match="top_k=0"):
        SamplingConfig(top_k=0)
    with pytest.raises(ValueError, match="left-padded"):
        HFRolloutEngine(model_path, config=RolloutConfig(backend="hf")).generate(
            {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])},
            SamplingConfig())
