"""Partial rollouts (rollout.partial_budget) on real Ray, vLLM and gloo: responses cut at the budget are
continued in later steps by newer weights, their stitched tokens and log-probs stay aligned (the
rollout engine's log-probs equal the trainer's recomputation token by token while the weights stay
put), responses are continued by newer weights, and a resume from a checkpoint taken with responses in
progress continues them exactly."""

import json
import math
from pathlib import Path

import pytest

from rlframe.config import load_config, validate
from rlframe.config.validate import ConfigError
from rlframe.controller.lifecycle.checkpoint import STATE_FILE
from tests.controller.trainers.test_end_to_end import COMMON, run

BUDGET, RESPONSE = 3, 6
# A learning rate too small to move an fp32 weight: every segment, old or new, was sampled by the
# weights the trainer recomputes log-probs with, so they must agree wherever the tokens are aligned.
PARTIAL = ["data.train_batch_size=8", "algorithm.n_samples=2", f"rollout.partial_budget={BUDGET}", f"data.response_length={RESPONSE}",
           "actor.lr=1e-30", "algorithm.off_policy_correction=tis", "trainer.val_every=0", "trainer.total_steps=4",
           "trainer.save_every=2", "trainer.export_hf=false", "actor.mini_batch_size=16"]
EXACT = ("critic/score/mean", "response_length/mean", "partial/rounds", "partial/segments_mean",
         "partial/continued_frac", "partial/pool_groups", "partial/unfinished_samples", "async/staleness",
         "async/staleness_mean", "rollout/logprob_diff_mean")


def _rows(summary):
    return {r["step"]: r for r in map(json.loads, (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_partial_rollouts_continue_across_updates_and_resume(tmp_path, ray_cluster):
    _, summary = run("grpo_tiny", PARTIAL, tmp_path / "a")
    rows = _rows(summary)
    steps = [rows[t] for t in (1, 2, 3, 4)]
    for t, r in enumerate(steps, start=1):
        assert r["rollout/logprob_diff_mean"] < 1e-3 and r["rollout/logprob_diff_max"] < 2e-2, r
        assert 0.0 <= r["async/staleness_mean"] <= r["async/staleness"] <= t - 1
        assert 1.0 <= r["partial/segments_mean"] <= math.ceil(RESPONSE / BUDGET) + 0.0
    assert steps[0]["async/staleness"] == 0.0  # nothing older than the first weights exists
    assert any(r["partial/continued_frac"] > 0 for r in steps)
    assert any(r["async/staleness"] >= 1 for r in steps[1:]), "no response was continued by newer weights"

    # responses in progress at step 2 are in the checkpoint, and a resumed run continues them exactly
    ckpt = Path(summary["run_dir"]) / "checkpoints" / "step_000002"
    pool = json.loads((ckpt / STATE_FILE).read_text())["partial_rollouts"]["pool"]
    assert rows[2]["partial/pool_groups"] == len(pool)
    _, resumed = run("grpo_tiny", PARTIAL + [f"trainer.resume={ckpt}"], tmp_path / "b")
    again = _rows(resumed)
    for t in (3, 4):
        assert {k: again[t][k] for k in EXACT} == {k: rows[t][k] for k in EXACT}, t


@pytest.mark.parametrize("extra, says", [
    (["trainer.max_staleness=1", "resources.placement=split"], "trainer.max_staleness > 0"),
    (["algorithm.dynamic_sampling=true"], "dynamic_sampling"),
    (["rollout.partial_budget=8"], "no response is ever cut"),
])
def test_partial_budget_conflicts_are_config_errors(extra, says):
    with pytest.raises(ConfigError, match=says):
        validate(load_config("grpo_tiny", COMMON + ["rollout.partial_budget=2"] + extra))
