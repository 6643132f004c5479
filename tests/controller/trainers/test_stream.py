"""Streaming rollouts (trainer.async_mode=stream, split placement) on real Ray, vLLM and gloo: the
generation group runs in rounds of rollout.partial_budget tokens while the trainer trains, every
sample's staleness stays within trainer.max_staleness (asserted per sample in the trainer too),
responses are cut into rounds and continued, and a resume from a checkpoint taken with groups in
flight trains every prompt exactly once. (Whether a response's rounds span a weight load depends on
timing; that a continued response equals an uninterrupted one is test_vllm_engine.py's.)"""

import json
from collections import Counter
from pathlib import Path

import pytest

from rlframe.config import load_config, validate
from rlframe.config.validate import ConfigError
from rlframe.controller.lifecycle.checkpoint import STATE_FILE
from tests.controller.trainers.test_end_to_end import COMMON, run

K, BUDGET = 2, 2
# a non-default temperature, two mini-batches per step (8 prompts x 2 samples, mini-batch 8), rounds of
# 2 tokens against responses of up to 6 (the sums' 1-3 digits and EOS: most take two rounds or more)
STREAM = ["data.train_batch_size=8", "algorithm.n_samples=2", "resources.placement=split", "actor.dp=1",
          "+resources.split_procs={actor: 1, rollout: 1}", f"trainer.max_staleness={K}", "trainer.async_mode=stream",
          f"rollout.partial_budget={BUDGET}", "rollout.temperature=0.8", "actor.mini_batch_size=8",
          "actor.micro_batch_size=4", "algorithm.off_policy_correction=tis", "trainer.val_every=0",
          "trainer.total_steps=4", "trainer.save_every=2", "trainer.export_hf=false", "trainer.rollout_dump_every=1",
          "trainer.rollout_dump_rows=1000"]


def _rows(summary):
    return {r["step"]: r for r in map(json.loads, (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines())}


def _trained(summary, steps) -> dict[int, list[str]]:
    """step -> the uids (prompt groups) trained at that step, from the generations dump."""
    out: dict[int, list[str]] = {}
    path = Path(summary["run_dir"]) / "generations" / "train.jsonl"
    for row in map(json.loads, path.read_text().splitlines()):
        if row["step"] in steps:
            out.setdefault(row["step"], []).append(row["uid"])
    return {s: sorted(set(u)) for s, u in out.items()}


@pytest.mark.slow
def test_streaming_rollouts_bound_staleness_continue_across_updates_and_resume(tmp_path, ray_cluster):
    _, summary = run("grpo_tiny", STREAM, tmp_path / "a")
    rows = _rows(summary)
    assert sorted(s for s in rows if s >= 1) == [1, 2, 3, 4]
    for t in (1, 2, 3, 4):
        r = rows[t]
        assert 0.0 <= r["async/staleness_mean"] <= r["async/staleness"] <= min(K, t - 1), r
        assert r["stream/segments_mean"] > 1.0, r  # responses were cut into rounds and continued
        assert r["stream/gen_tokens"] >= 0 and r["critic/score/mean"] >= 0.0
    trained = _trained(summary, {1, 2, 3, 4})
    assert all(len(trained[t]) == 8 for t in (1, 2, 3, 4)), trained
    uids = [u for t in (1, 2, 3, 4) for u in trained[t]]
    assert len(set(uids)) == len(uids), Counter(uids).most_common(3)  # no group trained twice

    # the checkpoint of step 2 holds every group drawn and not yet trained, with its tokens so far
    ckpt = Path(summary["run_dir"]) / "checkpoints" / "step_000002"
    state = json.loads((ckpt / STATE_FILE).read_text())
    pool = [g["fields"]["uid"] for g in state["stream_rollouts"]["pool"]]
    assert state["dataloader"]["epoch"] == 0
    drawn = state["dataloader"]["position"]  # prompts drawn so far
    assert len(pool) + 16 == drawn, (len(pool), drawn)  # 2 steps x 8 trained, the rest in the pool
    assert not set(pool) & set(trained[1] + trained[2])

    # the resumed run checks the rollout's weights after each step: pushed at a round's boundary, compared,
    # and the rounds after it record the pushed version (the per-sample staleness bound still holds)
    _, resumed = run("grpo_tiny", STREAM + [f"trainer.resume={ckpt}", "trainer.check_weight_sync_every=1"],
                     tmp_path / "b")
    checked = _rows(resumed)
    for t in (3, 4):
        assert checked[t]["sync/checked_slices"] > 0 and checked[t]["sync/mismatched_slices"] == 0, checked[t]
        assert 0.0 <= checked[t]["async/staleness"] <= K
    again = _trained(resumed, {3, 4})
    after = [u for t in (3, 4) for u in again[t]]
    assert len(set(after)) == len(after) == 16
    assert not set(after) & set(trained[1] + trained[2])  # nothing trained twice across the resume
    # the groups in flight at the checkpoint are trained first or still in flight at the end: none lost
    end = json.loads((Path(resumed["run_dir"]) / "checkpoints" / "step_000004" / STATE_FILE).read_text())
    still = {g["fields"]["uid"] for g in end["stream_rollouts"]["pool"]}
    assert set(pool) <= set(after) | still


@pytest.mark.parametrize("extra, says", [
    (["trainer.max_staleness=0"], "max_staleness >= 1"),
    (["rollout.partial_budget=0"], "rounds of rollout.partial_budget"),
    (["resources.placement=colocated"], "resources.placement=split"),
])
def test_stream_mode_config_errors(extra, says):
    base = [o for o in STREAM if not o.startswith(("resources.", "+resources.", "actor.dp"))] + \
        (["resources.placement=split", "+resources.split_procs={actor: 1, rollout: 1}"]
         if "resources.placement=colocated" not in extra else [])
    with pytest.raises(ConfigError, match=says):
        validate(load_config("grpo_tiny", COMMON + base + extra))


def test_a_checkpoint_with_responses_in_progress_resumes_only_in_the_mode_that_wrote_them():
    from rlframe.controller.trainers.ppo import _check_in_flight
    from rlframe.controller.trainers.stream_rollout import _check_resumable

    stream = validate(load_config("grpo_tiny", COMMON + STREAM))
    batch = validate(load_config("grpo_tiny", COMMON + [o for o in STREAM if "async_mode" not in o
                                                        and "partial_budget" not in o]))
    partial = validate(load_config("grpo_tiny", COMMON + ["rollout.partial_budget=2"]))
    group = {"prompt": [5], "fields": {"uid": "e0-p0-0"}, "samples": []}
    streamed, cut = {"stream_rollouts": {"pool": [group]}}, {"partial_rollouts": {"pool": [group]}}
    _check_in_flight(streamed, stream, checkpoint="ck")
    _check_in_flight(cut, partial, checkpoint="ck")
    _check_in_flight({"stream_rollouts": {"pool": []}}, batch, checkpoint="ck")  # nothing in flight: any mode
    for state, cfg in ((streamed, batch), (streamed, partial), (cut, stream), (cut, batch)):
        with pytest.raises(ValueError, match="which this run would drop; resume it with"):
            _check_in_flight(state, cfg, checkpoint="ck")
    _check_resumable({"pool": [], "train_batch_size": 8, "max_staleness": 2}, batch_size=8, max_staleness=3)
    for b, k in ((4, 2), (8, 1)):
        with pytest.raises(ValueError, match="data.train_batch_size=8 and trainer.max_staleness >= 2"):
            _check_resumable({"pool": [], "train_batch_size": 8, "max_staleness": 2}, batch_size=b, max_staleness=k)
