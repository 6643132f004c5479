"""The `rlframe` command: run/submit/status/logs/metrics/stop, against the token-authenticated test
cluster of tests/jobs/test_jobs.py (shared: one `ray start --head` per session, stopped at its end)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlframe import jobs
from rlframe.cli import main
from rlframe.utils.ports import free_ports
from tests.jobs.test_jobs import _py, job_cluster  # noqa: F401  (the shared cluster fixture)


def test_run_is_the_main_job(capsys):
    assert main(["run", "--config-name", "grpo_tiny", "trainer.dry_run=true"]) == 0
    assert "config grpo_tiny: valid" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--steps", "3", "--config-name", "grpo_tiny", "actor.lr=2e-5"],
                                  ["--config-name", "grpo_tiny", "--steps", "3", "actor.lr=2e-5"],
                                  ["--config-name", "grpo_tiny", "actor.lr=2e-5", "--steps", "3"]])
def test_preflight_takes_steps_anywhere_among_its_arguments(argv, monkeypatch, tmp_path):
    """`--steps` before or after the config and its overrides (the run itself is replaced: nothing starts)."""
    seen = {}

    class Report:
        exit_code = 0

        def text(self):
            return "preflight grpo_tiny: 0 checks, 0 failed"

    def fake_run(cfg, *, steps, config_name):
        seen.update(steps=steps, name=config_name, lr=cfg.actor.lr)
        return Report()

    monkeypatch.setattr("rlframe.controller.preflight.run.run_preflight", fake_run)
    assert main(["preflight", *argv, f"trainer.output_dir={tmp_path}"]) == 0
    assert seen == {"steps": 3, "name": "grpo_tiny", "lr": 2e-5}


def test_preflight_help_is_its_own(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["preflight", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rlframe preflight") and "--steps STEPS" in out
    with pytest.raises(SystemExit) as exc:
        main(["preflight", "--steps", "0"])
    assert exc.value.code == 2 and "at least 1" in capsys.readouterr().err


def test_usage_errors_exit_2_with_the_fix(capsys):
    assert main(["submit", "grpo_tyni", "--address", f"127.0.0.1:{free_ports(1)[0]}"]) == 2
    assert "available: " in capsys.readouterr().err
    assert main(["status", "some-job", "--address", f"127.0.0.1:{free_ports(1)[0]}"]) == 2
    assert "ray start --head" in capsys.readouterr().err


def test_console_script_submit_follow_then_status_and_logs(job_cluster, tmp_path, capsys):
    cluster, _ = job_cluster
    script = Path(sys.executable).with_name("rlframe")
    proc = subprocess.run([str(script), "submit", "grpo_tiny", "trainer.dry_run=true", "--follow",
                           "--output-dir", str(tmp_path), "--address", cluster.address],
                          capture_output=True, text=True, timeout=180, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    job_id = re.search(r"job_id: (\S+)", proc.stdout).group(1)
    assert f"run_dir: {tmp_path / 'grpo_tiny'}" in proc.stdout
    assert "config grpo_tiny: valid" in proc.stdout  # the streamed log
    assert main(["status", job_id, "--address", cluster.address]) == 0
    out = capsys.readouterr().out
    assert "status: SUCCEEDED" in out and "steps logged: 0" in out
    assert main(["logs", job_id, "--tail", "200", "--address", cluster.address]) == 0
    assert "config grpo_tiny: valid" in capsys.readouterr().out


def test_metrics_and_failure_exit_code(job_cluster, tmp_path, capsys):
    cluster, _ = job_cluster
    rows = "\\n".join(f'{{"step": {s}, "critic/score/mean": {s / 2}}}' for s in (1, 2, 3))
    script = f"import pathlib; pathlib.Path({str(tmp_path)!r}, 'metrics.jsonl').write_text('{rows}\\n')"
    handle = jobs.submit_command(_py(script), run_dir=tmp_path, address=cluster.address)
    handle.wait(timeout_s=120)
    assert main(["metrics", handle.job_id, "--name", "critic/score/mean", "--address", cluster.address]) == 0
    assert capsys.readouterr().out.split("\n") == ["1 0.5", "2 1.0", "3 1.5", ""]
    failing = jobs.submit_command(_py("raise SystemExit('bad-input-91')"), address=cluster.address)
    assert main(["logs", failing.job_id, "--follow", "--address", cluster.address]) == 1
    captured = capsys.readouterr()
    assert "bad-input-91" in captured.out and "FAILED" in captured.err


def test_stop(job_cluster, capsys):
    cluster, _ = job_cluster
    handle = jobs.submit_command(_py("import time; print('up', flush=True); time.sleep(120)"), address=cluster.address)
    next(handle.follow_logs(poll_s=0.5, timeout_s=60))
    assert main(["stop", handle.job_id, "--address", cluster.address]) == 0
    assert f"job {handle.job_id}: STOPPED" in capsys.readouterr().out
    with pytest.raises(jobs.JobFailedError):
        handle.wait(timeout_s=5)
