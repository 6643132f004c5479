"""A worker process killed in the middle of a step does not end the run: the driver names the
group, roles and rank, starts the groups again, resumes from the newest checkpoint, and finishes
with the metrics of a run that was never interrupted. Past trainer.max_restarts it fails with the
history."""

import json
from pathlib import Path

import pytest

from rlframe.config import load_config, validate
from rlframe.controller.run import run_training
from rlframe.controller.lifecycle.restart import WorkerRestartsExhausted
from tests.controller.trainers.test_end_to_end import COMMON
from tests.measured import MEASURED

RUN = COMMON + ["data.train_batch_size=4", "algorithm.use_kl_loss=false", "ref.enabled=false",
                "trainer.total_steps=4", "trainer.save_every=2", "trainer.val_every=0", "trainer.export_hf=false"]
WORKERS = "actor.worker_cls=tests.controller.trainers.faulty_workers:"


def train(tmp_path: Path, name: str, *extra: str) -> Path:
    cfg = validate(load_config("grpo_tiny", RUN + [f"trainer.output_dir={tmp_path}", f"trainer.experiment={name}",
                                                   *extra]))
    run_training(cfg)
    return tmp_path / name


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows}


@pytest.mark.slow
def test_killed_worker_is_restarted_and_the_run_matches_an_uninterrupted_one(tmp_path, ray_cluster, capsys):
    reference = metrics(train(tmp_path, "reference"))
    run_dir = train(tmp_path, "killed", WORKERS + "KilledOnceActor")
    out = capsys.readouterr().out
    assert (run_dir / "killed-once").is_file()  # rank 1 really was SIGKILLed, in step 3's actor update
    assert "step 3: worker group 'hybrid' (roles actor) rank 1 died" in out, out[-3000:]
    assert "restart 1 of 1" in out and "step_000002" in out and "resumed from" in out, out[-3000:]
    restarted = metrics(run_dir)
    assert sorted(restarted) == [1, 2, 3, 4]
    for step in (3, 4):
        assert restarted[step] == reference[step], (step, restarted[step], reference[step])


@pytest.mark.slow
def test_more_deaths_than_max_restarts_fail_with_the_history(tmp_path, ray_cluster):
    with pytest.raises(WorkerRestartsExhausted, match=r"died 1 times, more than trainer.max_restarts=0") as err:
        train(tmp_path, "always", WORKERS + "AlwaysKilledActor", "trainer.max_restarts=0")
    assert "attempt 1, step 1: worker group 'hybrid' (roles actor) rank 1 died" in str(err.value)


def test_a_restart_continues_the_branch_this_attempt_saved(tmp_path):
    """Resumed from an explicit older checkpoint (step 10, beside an abandoned step 20), the attempt saved
    step 15 and then lost a worker: the next attempt continues from step 15, not from the newer-numbered
    step 20; an attempt that saved nothing (or whose checkpoint is gone) keeps its own trainer.resume."""
    import shutil
    from types import SimpleNamespace

    from rlframe.controller.lifecycle.restart import _resume_after_failure

    older, abandoned, mine = (tmp_path / f"step_{s:06d}" for s in (10, 20, 15))
    for d in (older, abandoned, mine):
        d.mkdir()
    assert _resume_after_failure(SimpleNamespace(saved=mine, resumed_from=older)) == mine
    assert _resume_after_failure(SimpleNamespace(saved=older, resumed_from=older)) is None
    assert _resume_after_failure(SimpleNamespace(saved=None, resumed_from=None)) is None
    shutil.rmtree(mine)
    assert _resume_after_failure(SimpleNamespace(saved=mine, resumed_from=older)) is None
