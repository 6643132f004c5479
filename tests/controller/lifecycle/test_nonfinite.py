"""Non-finite values are logged as NaN and counted, skipped optimizer steps are counted, and a run
whose steps stay non-finite stops with a clear error."""

import json
import math
from pathlib import Path

import pytest

from rlframe.config import load_config, validate
from rlframe.controller.run import run_training
from rlframe.controller.lifecycle.nonfinite import NonFiniteTrainingError
from rlframe.controller.lifecycle.tracking import Tracker
from tests.controller.trainers.test_end_to_end import COMMON


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_tracker_logs_nan_counts_and_stops_after_n_in_a_row(tmp_path):
    tracker = Tracker(tmp_path, sinks=["jsonl"], experiment="t", config={"trainer": {"max_nonfinite_steps": 2}},
                      plot=False)
    tracker.log({"actor/pg_loss": float("nan"), "actor/grad_norm": float("inf"), "actor/skipped": 1.0}, step=1)
    tracker.log({"actor/pg_loss": 0.5, "actor/skipped": 0.0}, step=2)  # a finite step ends the streak
    tracker.log({"actor/pg_loss": 0.4, "actor/skipped": 0.5}, step=3)  # half the updates skipped
    with pytest.raises(NonFiniteTrainingError, match=r"2 steps in a row \(steps 3-4\).*max_nonfinite_steps=2"):
        tracker.log({"actor/pg_loss": float("nan"), "actor/skipped": 1.0}, step=4)
    got = rows(tmp_path / "metrics.jsonl")  # the stopping step is written before the error
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert math.isnan(got[0]["actor/pg_loss"]) and math.isnan(got[0]["actor/grad_norm"])  # inf -> NaN
    assert [r["train/nonfinite_metrics"] for r in got] == [2.0, 0.0, 0.0, 1.0]
    assert [r["train/nonfinite_in_a_row"] for r in got] == [1.0, 0.0, 1.0, 2.0]
    assert [r["train/nonfinite_steps"] for r in got] == [1.0, 1.0, 2.0, 3.0]


@pytest.mark.slow
def test_run_with_a_nan_loss_skips_every_update_and_stops(tmp_path, ray_cluster):
    cfg = validate(load_config("grpo_tiny", COMMON + [
        "data.train_batch_size=4", "algorithm.use_kl_loss=false", "ref.enabled=false", "trainer.total_steps=4",
        "trainer.val_every=0", "trainer.export_hf=false", "trainer.max_nonfinite_steps=2",
        "actor.worker_cls=tests.controller.trainers.faulty_workers:NonFiniteLossActor",
        f"trainer.output_dir={tmp_path}", "trainer.experiment=nan_loss"]))
    with pytest.raises(NonFiniteTrainingError, match=r"2 steps in a row \(steps 1-2\)"):
        run_training(cfg)
    got = rows(tmp_path / "nan_loss" / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2]
    for r in got:
        assert math.isnan(r["actor/loss"]) and math.isnan(r["actor/grad_norm"]), r  # the loss given to backward
        assert r["actor/skipped"] == 1.0, r  # every optimizer step of the step was skipped
        assert r["train/nonfinite_metrics"] >= 2
    assert [r["train/nonfinite_in_a_row"] for r in got] == [1.0, 2.0]
