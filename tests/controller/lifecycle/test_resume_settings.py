"""A resume keeps what the user says, and a run directory belongs to one run (2 PPO steps, tiny model).

Step 1 is trained and checkpointed; the run is resumed for step 2 with other learning rates, another
fixed KL coefficient and more total steps: step 2 uses the new values (before, the fsdp engine kept
the saved learning rates and the saved KL controller overwrote the coefficient), and the resume says
one line per changed setting. Then launches with other defining settings (trainer.seed) are refused
before anything starts, with trainer.resume=auto and =off alike, and leave every file as it was.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlframe.config import load_config, validate
from rlframe.controller.run import run_training
from tests.controller.trainers.test_end_to_end import COMMON

REPO = Path(__file__).resolve().parents[3]
RUN = COMMON + ["data.train_batch_size=16", "algorithm.kl_in_reward=true", "trainer.val_every=0",
                "trainer.export_hf=false", "trainer.save_every=1", "trainer.experiment=run"]


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in run_dir.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_resume_applies_changed_settings_and_another_runs_launch_is_refused(tmp_path, ray_cluster, capsys):
    def train(*extra):
        run_training(validate(load_config("ppo_tiny", RUN + [f"trainer.output_dir={tmp_path}", *extra])))

    train("trainer.total_steps=1")  # actor.lr 1e-4, critic.lr 1e-3, algorithm.kl_coef 0.001
    capsys.readouterr()
    train("trainer.total_steps=2", "actor.lr=5e-5", "critic.lr=2e-4", "algorithm.kl_coef=0.01")
    out = capsys.readouterr().out
    run_dir = tmp_path / "run"
    rows = metrics(run_dir)
    assert sorted(rows) == [1, 2]
    assert (rows[1]["actor/lr"], rows[1]["critic/lr"], rows[1]["actor/kl_coef"]) == (1e-4, 1e-3, 0.001)
    assert (rows[2]["actor/lr"], rows[2]["critic/lr"], rows[2]["actor/kl_coef"]) == (5e-5, 2e-4, 0.01), rows[2]
    said = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("[rlframe] resume: ")]
    assert [s.split(" changed")[0] for s in said] == ["resume: actor.lr", "resume: algorithm.kl_coef",
                                                      "resume: critic.lr", "resume: trainer.total_steps"], said
    assert "0.0001 -> 5e-05" in said[0] and "0.001 -> 0.01; fixed coefficient" in said[1]
    assert "resumed from" in out and "at step 1" in out
    ckpt_config = json.loads((run_dir / "checkpoints" / "step_000002" / "run.json").read_text())["config"]
    assert ckpt_config["actor"]["lr"] == 5e-5  # each checkpoint records the config it was written with

    before = snapshot(run_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    for resume in ("auto", "off"):
        proc = subprocess.run([sys.executable, "-m", "rlframe.main", *RUN, f"trainer.output_dir={tmp_path}",
                               "trainer.total_steps=2", "trainer.seed=1", f"trainer.resume={resume}"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
        err = proc.stderr
        assert f"run directory {run_dir} belongs to another run" in err and "trainer.seed: 0 there, 1 here" in err
        assert "trainer.experiment" in err and "Traceback" not in err, err
        assert "Started a local Ray" not in err, f"trainer.resume={resume}: refused only after Ray started"
    assert snapshot(run_dir) == before  # the other run's checkpoints, metrics, config.yaml untouched
