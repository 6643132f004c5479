"""PPO whose reward is a reward model's score: the tiny arithmetic RM (rlframe/data/tiny_rm.py), a stock
Qwen2ForSequenceClassification whose tokenizer is not the policy's, so every response is re-tokenized
from text. Two steps on the demo model (real Ray, FSDP, vLLM), as the cases of test_end_to_end.py."""

import json
import math
from pathlib import Path

import pytest

from rlframe.data.tiny_rm import build_reward_model
from tests.controller.trainers.test_end_to_end import run


@pytest.mark.slow
def test_ppo_with_a_reward_model_of_another_tokenizer(tmp_path, ray_cluster):
    rm = build_reward_model()
    _, summary = run("ppo_tiny", ["data.train_batch_size=16", f"reward.model_paths=[{rm}]"], tmp_path)
    rows = [json.loads(l) for l in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values()), r
    for r in steps:
        # the reward is the RM's score (ensemble of one: the model's own mean), accuracy the verifier's verdict
        assert r["reward/rm/mean"] == pytest.approx(r["reward/rm/0/mean"])
        assert 0.0 <= r["critic/accuracy"] <= 1.0 and "timing_s/reward" in r
    assert "val/accuracy" in rows[-1]
