"""rlframe.jobs against a real `ray start --head` cluster with token authentication.

The cluster is a separate process group on free ports with a private temp dir (never the session's
`ray_cluster` fixture, never `ray.init()` in this process): tests only talk HTTP to its job server.
One cluster serves this file and tests/test_cli.py; it is stopped at the end of the session, also
after failures (pytest's config cleanup).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from rlframe import jobs
from rlframe.jobs.auth import find_token, resolve_address
from rlframe.utils.ports import free_ports

_CLUSTER: dict = {}


def _shared_cluster(request) -> dict:
    """Start the token-authenticated test cluster once per session; stop it when pytest ends."""
    if not _CLUSTER:
        token_dir = Path(tempfile.mkdtemp(prefix="rlf_token_"))
        request.config.add_cleanup(lambda: shutil.rmtree(token_dir, ignore_errors=True))
        token_file = token_dir / "token"
        token_file.write_text("rlframe-test-token-" + os.urandom(12).hex())
        cluster = jobs.start_local_cluster(num_cpus=16, env={"RAY_AUTH_MODE": "token",
                                                             "RAY_AUTH_TOKEN_PATH": str(token_file)})
        request.config.add_cleanup(cluster.stop)
        _CLUSTER.update(cluster=cluster, token_file=token_file)
    return _CLUSTER


@pytest.fixture
def job_cluster(request, monkeypatch):
    """(cluster, token file) with this test's client environment pointed at the token file only."""
    shared = _shared_cluster(request)
    assert shared["cluster"].alive(), shared["cluster"].log_tail()
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(shared["token_file"]))
    return shared["cluster"], shared["token_file"]


def _py(code: str) -> str:
    return shlex.join([sys.executable, "-c", textwrap.dedent(code)])


# ---------------------------------------------------------------- no cluster needed

def test_find_token_follows_rays_order(tmp_path):
    path = tmp_path / "tok"
    path.write_text("from-file\n")
    assert find_token({"RAY_AUTH_TOKEN": "direct", "RAY_AUTH_TOKEN_PATH": str(path)})[0] == "direct"
    assert find_token({"RAY_AUTH_TOKEN_PATH": str(path)}) == ("from-file", f"RAY_AUTH_TOKEN_PATH file {path}")


def test_resolve_address():
    assert resolve_address("127.0.0.1:9000/") == "http://127.0.0.1:9000"
    assert resolve_address("https://head:443") == "https://head:443"


def test_no_cluster_says_how_to_start_one():
    port = free_ports(1)[0]
    with pytest.raises(jobs.ClusterNotFoundError, match=r"ray start --head"):
        jobs.connect(f"http://127.0.0.1:{port}")


def test_unknown_config_lists_available_before_contacting_a_cluster():
    with pytest.raises(ValueError, match=r"no config named 'grpo_tyni'.*grpo_tiny.*ppo_tiny"):
        jobs.submit("grpo_tyni", address=f"http://127.0.0.1:{free_ports(1)[0]}")


def test_invalid_override_is_rejected_before_submission():
    with pytest.raises(ValueError, match=r"actor.dp=3"):
        jobs.submit("grpo_tiny", ["actor.dp=3"], address=f"http://127.0.0.1:{free_ports(1)[0]}")


def test_run_dir_is_made_absolute_and_survives_hydra(tmp_path, monkeypatch):
    """A relative or spaced output_dir becomes one absolute override that Hydra reads back unchanged."""
    from rlframe.config import load_config
    from rlframe.jobs.client import _plan_run

    monkeypatch.chdir(tmp_path)
    overrides, run_dir = _plan_run("grpo_tiny", ["trainer.output_dir=rel", "trainer.experiment=e1"], None)
    assert run_dir == tmp_path / "rel" / "e1"
    assert overrides == ["trainer.experiment=e1", f"trainer.output_dir={tmp_path / 'rel'}"]
    overrides, run_dir = _plan_run("grpo_tiny", [], str(tmp_path / "with space"))
    assert load_config("grpo_tiny", overrides).trainer.output_dir == str(tmp_path / "with space")
    assert run_dir == tmp_path / "with space" / "grpo_tiny"


def test_read_metrics_skips_only_a_partial_last_line(tmp_path):
    rows = [{"step": 1, "critic/score/mean": 0.25}, {"step": 2, "critic/score/mean": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "cri')
    assert jobs.read_metrics(tmp_path) == rows
    (tmp_path / "metrics.jsonl").write_text('{"step": 1\n' + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        jobs.read_metrics(tmp_path)
    assert jobs.read_metrics(tmp_path / "missing") == []


# ---------------------------------------------------------------- against the cluster

def test_token_is_required_and_found_without_code(job_cluster, tmp_path, monkeypatch):
    cluster, _ = job_cluster
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    # The cluster really enforces tokens: Ray's client in a process without RAY_AUTH_MODE is refused.
    with monkeypatch.context() as m:
        m.delenv("RAY_AUTH_MODE", raising=False)
        with pytest.raises(AuthenticationError):
            JobSubmissionClient(cluster.address).list_jobs()
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    with monkeypatch.context() as m:
        m.setenv("RAY_AUTH_TOKEN_PATH", str(wrong))
        with pytest.raises(PermissionError, match="rejected the token"):
            jobs.connect(cluster.address)
    with monkeypatch.context() as m:
        m.delenv("RAY_AUTH_TOKEN_PATH")
        m.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token either
        with pytest.raises(PermissionError, match="uses token authentication but no token was found"):
            jobs.connect(cluster.address)
    assert isinstance(jobs.connect(cluster.address).list_jobs(), list)


def test_dry_run_job_succeeds_and_can_be_attached(job_cluster, tmp_path):
    cluster, _ = job_cluster
    handle = jobs.submit("grpo_tiny", ["trainer.dry_run=true"], address=cluster.address, output_dir=str(tmp_path))
    assert handle.run_dir == tmp_path / "grpo_tiny"
    assert handle.wait(timeout_s=120) == "SUCCEEDED"
    assert "config grpo_tiny: valid" in handle.logs()
    again = jobs.attach(handle.job_id, address=cluster.address)
    assert (again.run_dir, again.config_name, again.status()) == (handle.run_dir, "grpo_tiny", "SUCCEEDED")
    with pytest.raises(ValueError, match="no job 'no-such-job'"):
        jobs.attach("no-such-job", address=cluster.address)


def test_metrics_logs_and_ray_inside_the_job(job_cluster, tmp_path):
    """A job that writes metrics.jsonl like the trainer and joins the cluster (token passed on by Ray)."""
    cluster, _ = job_cluster
    expected = [{"step": s, "critic/score/mean": s / 4, "timing_s/step": 0.5} for s in range(1, 5)]
    script = f"""
        import json, time, pathlib, ray
        ray.init()  # RAY_ADDRESS is set by the job server; the token comes from the cluster's env
        print("answer", ray.get(ray.remote(lambda: 41 + 1).options(num_cpus=0).remote()), flush=True)
        d = pathlib.Path({str(tmp_path / 'run')!r}); d.mkdir(parents=True, exist_ok=True)
        for row in {expected!r}:
            with open(d / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\\n")
            print("step", row["step"], flush=True)
            time.sleep(0.3)
    """
    handle = jobs.submit_command(_py(script), run_dir=tmp_path / "run", address=cluster.address)
    streamed = "".join(handle.follow_logs(poll_s=0.5, timeout_s=120))
    assert handle.wait(timeout_s=10) == "SUCCEEDED", handle.log_tail()
    assert "answer 42" in streamed and all(f"step {s}" in streamed for s in range(1, 5))
    assert handle.metrics() == expected
    assert handle.metric("critic/score/mean") == ([1, 2, 3, 4], [0.25, 0.5, 0.75, 1.0])


def test_failed_job_raises_with_log_tail(job_cluster):
    cluster, _ = job_cluster
    handle = jobs.submit_command(_py("print('boom-7f3a', flush=True); raise SystemExit(3)"), address=cluster.address)
    with pytest.raises(jobs.JobFailedError, match=r"(?s)ended FAILED.*boom-7f3a") as err:
        handle.wait(timeout_s=120)
    assert err.value.status == "FAILED"


def test_stop_a_running_job(job_cluster):
    cluster, _ = job_cluster
    handle = jobs.submit_command(_py("import time; print('started', flush=True); time.sleep(120)"),
                                 address=cluster.address)
    for _ in handle.follow_logs(poll_s=0.5, timeout_s=60):
        break  # first output: the job is running
    assert handle.status() == "RUNNING"
    assert handle.stop(wait_s=30) == "STOPPED"
    with pytest.raises(jobs.JobFailedError, match="ended STOPPED"):
        handle.wait(timeout_s=5)


def test_notebook_runs_top_to_bottom(job_cluster, tmp_path, monkeypatch):
    """examples/submit_from_notebook.ipynb with a 2-step tiny GRPO job; the plotted metrics must exist."""
    import nbformat
    from nbclient import NotebookClient

    cluster, _ = job_cluster
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("RLFRAME_RAY_ADDRESS", cluster.address)
    monkeypatch.setenv("RLFRAME_NB_CONFIG", "grpo_tiny")
    # grpo_tiny made as short as it gets: 2 steps, one process, HF rollout, a 5-step pre-trained model
    # (cached after the first run; the default 350-step pre-training alone takes minutes here).
    monkeypatch.setenv("RLFRAME_NB_OVERRIDES", " ".join([
        "trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0", "model.tiny_pretrain_steps=5",
        "rollout.backend=hf", "resources.procs_per_node=1", "actor.dp=1", "data.train_batch_size=4",
        "actor.mini_batch_size=16", "actor.micro_batch_size=16"]))
    monkeypatch.setenv("RLFRAME_NB_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("RLFRAME_NB_WATCH_S", "400")
    nb = nbformat.read(repo / "examples" / "submit_from_notebook.ipynb", as_version=4)
    NotebookClient(nb, timeout=450, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "final status: SUCCEEDED" in text, text[-3000:]
    rows = jobs.read_metrics(tmp_path / "grpo_tiny")
    assert [r["step"] for r in rows if "critic/score/mean" in r] == [1, 2]
    assert "plotted 2 points of critic/score/mean" in text
    assert (tmp_path / "grpo_tiny" / "notebook_reward.png").stat().st_size > 0
