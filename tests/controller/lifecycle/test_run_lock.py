"""One run directory, one live run: a second launch is refused at once naming the holder; a lock
whose process was SIGKILLed (or whose other-host heartbeat is old) is taken over with a message."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlframe.controller.lifecycle.run_lock import LOCK_FILE, RunLock, RunLocked, RunLockLost, check_held
from tests.controller.trainers.test_end_to_end import COMMON
from tests.controller.lifecycle.test_resume import kill_session

REPO = Path(__file__).resolve().parents[3]



@pytest.fixture(scope="module", autouse=True)
def _zygote(zygote_for_subprocess_runs):
    """The launched runs' workers fork from the session's preloaded server (tests/zygote.py)."""


def write_lock(run_dir: Path, **fields) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    info = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": None, "boot_id": None,
            "started": time.time() - 3600, "started_at": "an hour ago", "heartbeat": time.time(), "token": "t0",
            **fields}
    (run_dir / LOCK_FILE).write_text(json.dumps(info))
    return run_dir / LOCK_FILE


def test_live_holder_on_another_host_refuses_until_its_heartbeat_is_old(tmp_path):
    write_lock(tmp_path, host="node-7", pid=4242)
    with pytest.raises(RunLocked) as err:
        RunLock(tmp_path, stale_after_s=60).acquire()
    said = str(err.value)
    assert "host 'node-7' pid 4242" in said and "running since an hour ago (60 min ago)" in said
    assert "trainer.experiment" in said and "heartbeat is 60 s old" in said

    write_lock(tmp_path, host="node-7", pid=4242, heartbeat=time.time() - 600)
    said = []
    lock = RunLock(tmp_path, stale_after_s=60, announce=said.append).acquire()
    try:
        assert "taking over" in said[0] and "node-7" in said[0] and "heartbeat is 10 min old" in said[0]
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_dead_process_on_this_host_is_taken_over_at_once_whatever_its_heartbeat(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_lock(tmp_path, pid=gone.pid)  # heartbeat: now
    said = []
    with RunLock(tmp_path, stale_after_s=3600, announce=said.append):
        assert f"process {gone.pid} on this host is gone" in said[0]
        with pytest.raises(RunLocked, match="already held by this process"):
            RunLock(tmp_path).acquire()


def test_heartbeat_refreshes_and_a_lost_lock_stops_saves(tmp_path):
    said = []
    lock = RunLock(tmp_path, stale_after_s=60, heartbeat_s=0.1, announce=said.append).acquire()
    try:
        first = json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"]
        time.sleep(0.5)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"] > first
        check_held(tmp_path)
        write_lock(tmp_path, host="node-3", pid=99, token="theirs")  # taken over while we stalled
        time.sleep(0.5)
        assert lock.lost and "LOST" in said[-1] and "node-3" in said[-1]
        with pytest.raises(RunLockLost, match="stopping before writing"):
            check_held(tmp_path)
    finally:
        lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "theirs"  # not ours to delete


def test_a_live_runs_directory_is_named_before_its_metrics_port(tmp_path, capsys):
    """A second launch of a live run that serves /metrics: refused for the run directory in use (the
    real reason), not for the port (held by that run), whose suggested free port only led to the lock."""
    from rlframe.controller.lifecycle.run_lock import live_holder
    from rlframe.main import main

    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # the live run's endpoint
    held.listen()
    port = held.getsockname()[1]
    try:
        write_lock(tmp_path / "run")  # the live run: this process, on this host
        code = main([*COMMON, "data.train_batch_size=16", f"trainer.output_dir={tmp_path}", "trainer.experiment=run",
                     f"trainer.prometheus_port={port}", "trainer.prometheus_host=127.0.0.1"])
    finally:
        held.close()
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"is in use by another run: host {socket.gethostname()!r} pid {os.getpid()}" in err, err
    assert "prometheus_port" not in err, err

    write_lock(tmp_path / "gone", pid=2**22 + 1)  # a holder that is gone: the launch takes the lock over
    assert live_holder(tmp_path / "gone") is None and live_holder(tmp_path / "none") is None

def launch(out_dir: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "rlframe.main", *COMMON, "data.train_batch_size=16", "trainer.total_steps=1",
            "trainer.val_every=0", "trainer.export_hf=false", "trainer.progress_bar=false",
            f"trainer.output_dir={out_dir}", "trainer.experiment=run", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_second_launch_refused_while_the_first_runs(tmp_path):
    """(The take-over of a SIGKILLed run's lock is test_resume.py's test_sigkill_and_resume_...)"""
    first = launch(tmp_path)
    lock = tmp_path / "run" / LOCK_FILE
    deadline = time.monotonic() + 120
    while not lock.exists():
        assert first.poll() is None, first.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the first launch took no lock within 120 s"
        time.sleep(0.1)

    second = launch(tmp_path)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 2, out[-3000:]
    assert f"is in use by another run: host {socket.gethostname()!r} pid {first.pid}, running since" in out, out[-3000:]
    assert "Traceback" not in out
    assert "Started a local Ray" not in out  # refused before Ray (or any worker) started
    assert first.poll() is None  # the holder was not disturbed

    kill_session(first.pid)
    first.wait()
