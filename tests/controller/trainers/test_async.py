"""Asynchronous training (trainer.max_staleness=2, split placement) on real Ray, vLLM and gloo:
the pipeline refills every k steps (batches 1-3 launched at step 1, batch 4 at step 3), the next
batches generate while step t trains (wall-clock timestamps from both groups), no batch is staler
than k (seq_mask_tis with a KL bound corrects it), and a checkpoint taken with a batch in flight
resumes without losing or repeating one. The weight check (trainer.check_weight_sync_every=1) compares
right after the pipeline's pushes. The first run is traced and serves /metrics (trainer.trace, trainer.prometheus_port):
its timeline holds every call once per rank inside its step and shows the overlap, and a scrape
during the run sees the latest step."""

import json
import socket
import threading
import urllib.request
from pathlib import Path

import pytest

from rlframe.controller.lifecycle.checkpoint import STATE_FILE
from rlframe.utils.metrics_endpoint import port_problem
from tests.controller.trainers.test_end_to_end import run

ASYNC = ["data.train_batch_size=16", "resources.placement=split", "actor.dp=1", "critic.dp=1",
         "+resources.split_procs={actor: 1, rollout: 1}", "trainer.max_staleness=2", "trainer.val_every=0",
         "trainer.total_steps=4", "trainer.save_every=2", "algorithm.off_policy_correction=seq_mask_tis",
         "algorithm.rejection_kl=0.05"]


def _rows(summary):
    return {r["step"]: r for r in map(json.loads, (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines())}


def _position(run_dir, step):
    return json.loads((Path(run_dir) / "checkpoints" / f"step_{step:06d}" / STATE_FILE).read_text())["dataloader"]["position"]


class Scraper(threading.Thread):
    """Reads http://127.0.0.1:<port>/metrics every 0.5 s while the run goes on; keeps the last answer."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.url, self.last, self.stopped = f"http://127.0.0.1:{port}/metrics", "", threading.Event()

    def run(self):
        while not self.stopped.wait(0.5):
            try:
                self.last = urllib.request.urlopen(self.url, timeout=2).read().decode()
            except OSError:  # not serving yet, or no more
                pass


def check_timeline(run_dir: Path, *, steps: int, k: int = 2) -> None:
    """trace.json parses; each call is on every rank it was sent to once; every call's ranks ran after
    the driver entered the step it was issued in and were done by the end of k steps later (async:
    batch t+k may be issued in step t and trained in step t+k); a batch issued in an earlier step
    generates while the other groups work on a step's batch; the spans timed inside a call nest in it."""
    events = json.load(open(run_dir / "trace.json"))
    xs = [e for e in events if e["ph"] == "X"]
    groups = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"driver", "actor", "rollout"} <= set(groups.values())
    [run_span] = [e for e in xs if e["name"] == "run"]
    step_spans = {e["args"]["step"]: e for e in xs if e["name"] == "step"}
    assert sorted(step_spans) == list(range(1, steps + 1))

    def end(e):
        return e["ts"] + e["dur"]

    calls = [e for e in xs if e["cat"] == "call"]
    per_call = {}
    for e in calls:
        per_call.setdefault(e["args"]["call"], []).append(e)
        s = e["args"]["step"]
        lo = step_spans[s]["ts"] if s in step_spans else run_span["ts"]
        hi = end(step_spans[s + k]) if s + k in step_spans else end(run_span)
        assert lo <= e["ts"] and end(e) <= hi, (e, lo, hi)
    for ranks in per_call.values():
        assert len({e["tid"] for e in ranks}) == len(ranks) and len({e["pid"] for e in ranks}) == 1
    by_name = {}
    for e in calls:
        by_name.setdefault(groups[e["pid"]] + "." + e["name"], []).append(e)
    assert [e["args"]["step"] for e in by_name["actor.update_actor"]] == list(range(1, steps + 1))
    gens = by_name["rollout.generate_sequences"]
    assert [e["args"]["step"] for e in gens] == [1, 1, 1, 3][:steps]  # k=2: refilled at steps 1 and 3
    # a batch issued in step t generates while step t's batch is worked on by the other groups
    others = [e for e in calls if groups[e["pid"]] != "rollout" and e["args"]["step"] >= 1]
    assert any(g["ts"] < end(o) and o["ts"] < end(g) and g["args"]["step"] == o["args"]["step"]
               for g in gens[1:] for o in others)
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    rounds = [e for e in xs if lanes[(e["pid"], e["tid"])].startswith("generation rounds")]
    assert len(rounds) == steps and any(end(r) > end(step_spans[r["args"]["launched_at_step"]]) for r in rounds)
    inner = [e for e in xs if e["cat"] == "worker" and e["name"] == "gen_local"]
    assert len(inner) == steps
    for e in inner:
        [outer] = [c for c in per_call[e["args"]["call"]] if c["tid"] == e["tid"]]
        assert outer["ts"] <= e["ts"] and end(e) <= end(outer)
    assert any(e["name"] == "push_weights" for e in xs)


@pytest.mark.slow
def test_async_overlaps_generation_with_training_and_resumes(tmp_path, ray_cluster):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scraper = Scraper(port)
    scraper.start()
    try:
        _, summary = run("ppo_tiny", ASYNC + ["trainer.trace=true", f"trainer.prometheus_port={port}",
                                              "trainer.check_weight_sync_every=1"], tmp_path / "a")
    finally:
        scraper.stopped.set()
        scraper.join()
    check_timeline(Path(summary["run_dir"]), steps=4)
    assert f'rlframe_step{{run="{Path(summary["run_dir"]).name}"}}' in scraper.last, scraper.last
    assert "rlframe_critic_score_mean" in scraper.last
    with pytest.raises(OSError):  # the endpoint stopped with the run: nothing listens there
        urllib.request.urlopen(scraper.url, timeout=2)
    assert port_problem("127.0.0.1", port) is None
    rows = _rows(summary)
    assert [rows[t]["async/staleness"] for t in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 1.0]
    assert [rows[t]["async/policy_version"] for t in (1, 2, 3, 4)] == [0.0, 0.0, 0.0, 2.0]
    # the weight check compares right after a push (steps 3 and 4: the pipeline's push, then one at the
    # end with nothing in flight), never between an update and the next push, where nothing can match
    assert [("sync/checked_slices" in rows[t]) for t in (1, 2, 3, 4)] == [False, False, True, True]
    assert all(rows[t]["sync/checked_slices"] > 0 and rows[t]["sync/mismatched_slices"] == 0 for t in (3, 4))
    for t in (2, 3, 4):
        assert 0.0 < rows[t]["async/is_weight_mean"] and 0.0 <= rows[t]["async/is_clipped_frac"] <= 1.0
        # seq_mask_tis with rejection_kl: responses outside the band or over the KL bound leave the update
        assert 0.0 <= rows[t]["async/kl_rejected_frac"] <= rows[t]["async/masked_seq_frac"] <= 1.0
        assert 0.0 <= rows[t]["async/masked_token_frac"] <= 1.0
        assert (rows[t]["async/masked_seq_frac"] > 0) == (rows[t]["async/masked_token_frac"] > 0)
    # batch t+1 starts generating before step t's training ends, and their intervals overlap
    for t in (1, 2, 3):
        assert rows[t + 1]["async/gen_start_unix"] < rows[t]["async/train_end_unix"], t
    assert any(rows[t + 1]["async/gen_end_unix"] > rows[t]["async/train_start_unix"] for t in (1, 2, 3))

    # at step 2, batch 3 had been drawn and was generating: the checkpoint keeps the loader before it
    assert _position(summary["run_dir"], 2) == 2 * 16
    ckpt = Path(summary["run_dir"]) / "checkpoints" / "step_000002"
    # checking every 3 steps: step 3's request waits for a push that never comes (batch 4 was launched with
    # batch 3), so it is served at the last step, with nothing in flight
    _, resumed = run("ppo_tiny", ASYNC + [f"trainer.resume={ckpt}", "trainer.check_weight_sync_every=3"], tmp_path / "b")
    again = _rows(resumed)
    assert sorted(s for s in again if s > 0) == [3, 4]
    assert again[3]["async/staleness"] == 0.0  # regenerated by the resumed weights
    assert "sync/checked_slices" not in again[3] and again[4]["sync/checked_slices"] > 0
    assert again[4]["sync/mismatched_slices"] == 0
    assert _position(resumed["run_dir"], 4) == _position(summary["run_dir"], 4) == 4 * 16


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_refill_pushes_every_k_steps_and_keeps_staleness_within_k(k):
    from rlframe.controller.trainers.async_rollout import refill

    total, in_flight, gen_version, pushes, staleness = 13, [], 0, [], {}
    launched_by = {}
    for step in range(1, total + 1):
        push, launch = refill(step, [j for j, _ in in_flight], k=k, total=total)
        if push and gen_version < step - 1:
            gen_version = step - 1
            pushes.append(step)
        # a push comes only once the current step's batch is the last in flight
        assert not push or all(j == step for j, _ in in_flight)
        for j in launch:
            assert j not in launched_by
            launched_by[j] = step
            in_flight.append((j, gen_version))
        j, v = in_flight.pop(0)
        assert j == step
        staleness[step] = (step - 1) - v
    assert sorted(launched_by) == list(range(1, total + 1))
    assert max(staleness.values()) == k and min(staleness.values()) >= 0
    # the first refill needs no push (the group holds version 0), then one every k steps
    assert pushes == list(range(k + 1, total, k))  # none at the last step: nothing left to launch
