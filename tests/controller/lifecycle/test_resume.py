"""Kill -9 mid-run, or damage the newest checkpoint, resume, and reach the same metrics as a run that
was never interrupted (one uninterrupted run serves both tests)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from rlframe.controller.lifecycle.checkpoint import CheckpointManager
from rlframe.controller.lifecycle.run_lock import LOCK_FILE
from rlframe.controller.lifecycle.step_files import read_jsonl
from rlframe.utils import manifest
from tests.controller.trainers.test_end_to_end import COMMON
from tests.measured import MEASURED

REPO = Path(__file__).resolve().parents[3]



@pytest.fixture(scope="module", autouse=True)
def _zygote(zygote_for_subprocess_runs):
    """The launched runs' workers fork from the session's preloaded server (tests/zygote.py)."""


def launch(out_dir: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "rlframe.main", *COMMON, "data.train_batch_size=16", "trainer.total_steps=4",
            "trainer.save_every=2", "trainer.val_every=0", f"trainer.output_dir={out_dir}", "trainer.experiment=run",
            *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    # A session of its own: SIGKILL to the group takes the driver and the Ray it started.
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid`: the driver and the Ray processes it started."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # field 6 of /proc/PID/stat: session id
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


def metrics(out_dir: Path) -> dict[int, dict]:
    rows = [json.loads(l) for l in (out_dir / "run" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows}


def finish(proc: subprocess.Popen, timeout: float = 900) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-5000:]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    out_dir = tmp_path_factory.mktemp("uninterrupted")
    finish(launch(out_dir))
    return out_dir, metrics(out_dir)


# the interrupted run of the first test also dumps its generations and evaluates (steps 0, 2, 4)
DUMPS = ("trainer.rollout_dump_every=1", "trainer.val_every=2")


@pytest.mark.slow
def test_sigkill_and_resume_matches_uninterrupted(uninterrupted, tmp_path):
    """... and its generation dumps hold one row per sample of every step and evaluation, none twice
    (the rows the killed run wrote after its checkpoint were dropped by the resume)."""
    _, reference = uninterrupted
    proc = launch(tmp_path / "b", *DUMPS)
    ckpt = tmp_path / "b" / "run" / "checkpoints" / "step_000002"
    deadline = time.monotonic() + 900
    while not ckpt.exists():  # the step-2 checkpoint is complete once its final name exists
        assert proc.poll() is None, proc.stdout.read()[-5000:]
        assert time.monotonic() < deadline, "no checkpoint within 900 s"
        time.sleep(0.5)
    kill_session(proc.pid)
    proc.wait()

    out = finish(launch(tmp_path / "b", "trainer.resume=auto", *DUMPS))
    assert "resumed from" in out and "at step 2" in out
    lock = tmp_path / "b" / "run" / LOCK_FILE  # the killed driver's lock is taken over, and released at the end
    assert f"taking over {lock} from host {socket.gethostname()!r} pid {proc.pid}" in out, out[-5000:]
    assert f"process {proc.pid} on this host is gone" in out and not lock.exists()
    resumed = metrics(tmp_path / "b")
    assert sorted(resumed) == [0, 1, 2, 3, 4]  # 0: the evaluation before training
    for step in (3, 4):
        trained = {k: v for k, v in resumed[step].items() if not k.startswith(("val/", "memory/"))}  # evaluated here
        assert trained == reference[step], (step, trained, reference[step])

    generations = tmp_path / "b" / "run" / "generations"
    train, val = read_jsonl(generations / "train.jsonl"), read_jsonl(generations / "val.jsonl")
    keys = [(r["step"], r["index"]) for r in train]
    assert sorted(keys) == [(s, i) for s in (1, 2, 3, 4) for i in range(16)], keys  # each sample once
    assert all(r["policy_version"] == r["step"] - 1 for r in train)  # synchronous: the previous step's weights
    for step in (3, 4):  # every sample dumped: their rewards average to the step's logged score
        rewards = [r["reward"] for r in train if r["step"] == step]
        assert sum(rewards) / len(rewards) == pytest.approx(resumed[step]["critic/score/mean"], abs=1e-6)
    keys = [(r["step"], r["index"]) for r in val]
    assert sorted(keys) == [(s, i) for s in (0, 2, 4) for i in range(16)], keys  # data.val_size=16, greedy
    accuracy = [r["score_parts"]["acc"] for r in val if r["step"] == 4]
    assert sum(accuracy) / len(accuracy) == pytest.approx(resumed[4]["val/accuracy"])


@pytest.mark.slow
def test_damaged_checkpoint_is_refused_or_skipped(uninterrupted, tmp_path):
    """The uninterrupted run's newest checkpoint (step 4) gets a truncated actor shard and a flipped
    byte in the critic's engine state. An explicit path to it fails in the driver before Ray starts, naming
    the file; resume=auto warns naming both and falls back to step 2 (a run resumed from step 2 ends
    with the uninterrupted run's metrics: the SIGKILL test)."""
    src, _ = uninterrupted
    shutil.copytree(src / "run", tmp_path / "run")
    newest = tmp_path / "run" / "checkpoints" / "step_000004"
    shard = sorted((newest / "actor" / "model_optim").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    state = bytearray((newest / "critic" / "engine_state.pt").read_bytes())
    state[len(state) // 2] ^= 0xFF
    (newest / "critic" / "engine_state.pt").write_bytes(bytes(state))
    truncated, flipped = f"actor/model_optim/{shard.name} has", "critic/engine_state.pt has changed"

    proc = launch(tmp_path, f"trainer.resume={newest}")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-3000:]
    assert truncated in out and flipped in out and "Traceback" not in out, out[-3000:]
    assert "Started a local Ray" not in out  # refused in the driver's config check, before Ray started

    with pytest.warns(UserWarning, match="skipping") as said:  # what resume=auto continues from
        chosen = CheckpointManager(tmp_path / "run", keep=2).resolve("auto")
    assert chosen == tmp_path / "run" / "checkpoints" / "step_000002"
    said = " ".join(str(w.message) for w in said)
    assert f"skipping {newest}" in said and truncated in said and flipped in said


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()[-5000:]
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["mid_step"])  # "mid_checkpoint" (at step 2's .tmp directory) passes too: 4.7 s
def test_sigterm_checkpoints_and_exits(tmp_path, moment):
    """SIGTERM while step 2 trains (after step 1's metrics) or while step 2's checkpoint is written:
    the step in flight finishes, a complete checkpoint of it is kept (every file matches its manifest),
    and the run exits 143 with one line. (Resuming from a step-2 checkpoint and ending with the
    uninterrupted run's metrics is the SIGKILL test's.)"""
    run = tmp_path / "run"
    proc = launch(tmp_path)
    wait_for(run / "metrics.jsonl" if moment == "mid_step" else run / "checkpoints" / ".tmp-step_000002", proc)
    if moment == "mid_step":
        while not (run / "metrics.jsonl").read_text().strip():
            time.sleep(0.05)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    stopped_s = time.monotonic() - t0
    assert proc.returncode == 143, out[-5000:]
    line = [ln for ln in out.splitlines() if ln.startswith("rlframe: stopped on a signal")]
    assert len(line) == 1 and "step_000002" in line[0] and "SIGTERM received" not in out, out[-3000:]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    manifest.verify(run / "checkpoints" / "step_000002")
    assert sorted(metrics(tmp_path)) == [1, 2]  # the step in flight finished and logged; no later one began
    print(f"SIGTERM ({moment}) to exit: {stopped_s:.1f} s")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)")
def test_a_checkpoint_that_does_not_fit_leaves_nothing_and_the_run_resumes(uninterrupted, tmp_path):
    """A tmpfs with room for one checkpoint and the run's logs but not a second: the run ends with one
    line (directory, bytes needed and free, newest intact checkpoint), no partial directory is left,
    and resume=auto continues from the checkpoint written before the disk filled, which verifies
    (that a resumed run ends with the uninterrupted run's metrics is the SIGKILL test's)."""
    src, _ = uninterrupted
    ckpt_mb = sum(f.stat().st_size for f in (src / "run" / "checkpoints" / "step_000004").rglob("*") if f.is_file()) / 2**20
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(ckpt_mb * 1.5 + 8)}m", "tmpfs", str(disk)], check=True)
    try:
        proc = launch(disk, "trainer.save_every=1")
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 1, out[-5000:]
        said = [ln for ln in out.splitlines() if ln.startswith("rlframe: checkpoint of step 2 not written")]
        assert len(said) == 1 and "MiB are free" in said[0] and "step_000001" in said[0], out[-3000:]
        assert "Traceback" not in out.split(said[0])[-1]
        checkpoints = disk / "run" / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a checkpoint skipped as damaged would warn
            chosen = CheckpointManager(disk / "run", keep=2).resolve("auto")
        assert chosen == checkpoints / "step_000001"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
