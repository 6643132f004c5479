"""curves.png: drawn at most every PLOT_EVERY_S while a run logs (never at its first log, which is
on the start-up's path), and at close(). A full disk ends logging with one error. A resume drops the
rows of later steps from metrics.jsonl and generations/*.jsonl (rotated files too), so none is there
twice; a dump's first rows reach wandb and mlflow (where installed)."""

import importlib.util
import os
import subprocess

import pytest

from rlframe.controller.lifecycle import tracking
from rlframe.controller.lifecycle.step_files import read_jsonl
from rlframe.controller.lifecycle.tracking import SINK_ROWS, RunFilesWriteFailed, Tracker


def test_curves_are_drawn_after_plot_every_s_and_at_close(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(tracking.time, "monotonic", lambda: clock[0])
    tracker = Tracker(tmp_path, sinks=["jsonl"], experiment="t", config={}, plot=True)
    png = tmp_path / "curves.png"
    tracker.log({"val/accuracy": 0.4}, step=0)
    tracker.log({"critic/score/mean": 0.1}, step=1)
    assert not png.exists()
    clock[0] += tracking.PLOT_EVERY_S
    tracker.log({"critic/score/mean": 0.2}, step=2)
    assert png.exists()
    png.unlink()
    tracker.log({"critic/score/mean": 0.3}, step=3)  # within PLOT_EVERY_S of the last drawing
    assert not png.exists()
    tracker.close()
    assert png.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)")
def test_a_full_disk_ends_logging_with_one_error_not_a_thread_traceback(tmp_path, capfd):
    import subprocess

    from rlframe.controller.lifecycle.tracking import RunFilesWriteFailed, Tracker

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True)
    try:
        tracker = Tracker(disk, sinks=["jsonl", "tensorboard"], experiment="x", config={}, plot=False)
        metrics = {f"metric/{i:04d}": float(i) for i in range(400)}
        with pytest.raises(RunFilesWriteFailed, match=r"could not be written in .*the disk is full"):
            for step in range(1, 1000):
                tracker.log(metrics, step=step)
        tracker.close()  # nothing more is tried, nothing raised
        assert "Traceback" not in capfd.readouterr().err
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


TENSORBOARD_FILLS_THE_DISK = """
import sys, threading
from rlframe.controller.lifecycle.tracking import RunFilesWriteFailed, Tracker
tracker = Tracker(sys.argv[1], sinks=["tensorboard"], experiment="x", config={}, plot=False)
metrics = {f"metric/{i:04d}": float(i) for i in range(400)}
try:
    for step in range(1, 1000):
        tracker.log(metrics, step=step)
except RunFilesWriteFailed as err:
    print(err)
for thread in threading.enumerate():  # the writer thread has ended (and said what it says) before the exit
    if type(thread).__module__.startswith("tensorboard."):
        thread.join(timeout=60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)")
def test_tensorboards_writer_thread_prints_no_traceback_on_a_full_disk(tmp_path):
    """TensorBoard alone fills the disk: its writer thread's error ends the run as the one line, and the
    thread prints nothing of its own (it printed "Exception in thread ... event_file_writer.py")."""
    import sys

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True)
    try:
        proc = subprocess.run([sys.executable, "-c", TENSORBOARD_FILLS_THE_DISK, str(disk)], capture_output=True,
                              text=True, timeout=300)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert proc.returncode == 0, proc.stderr
    assert "the run's files could not be written" in proc.stdout and "the disk is full" in proc.stdout, proc.stdout
    assert "Exception in thread" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

def test_resume_drops_rows_after_the_checkpoint_so_none_is_twice(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    tracker = Tracker(run, sinks=["jsonl"], experiment="t", config={"trainer": {"rollout_dump_max_mb": 0.0015}},
                      plot=False)
    for step in range(1, 7):  # a step's rows outgrow a file (1.5 KiB here): each step rotates the files
        tracker.log({"critic/score/mean": 0.1 * step}, step=step)
        tracker.log_generations("train", [{"step": step, "index": i, "response": "y" * 500} for i in range(4)], step)
    files = tracker.generations["train"]
    assert [[r["step"] for r in read_jsonl(p)][0] for p in files.parts()] == [6, 5, 4]  # 5: rotated after step 4
    with files.path.open("a") as f:  # a kill mid-write cut the last line
        f.write('{"step": 6, "index": 4, "resp')
    tracker.close()

    again = Tracker(run, sinks=["jsonl"], experiment="t", config={"trainer": {"rollout_dump_max_mb": 0.0015}},
                    plot=False)
    again.resume_history(4)
    assert [r["step"] for r in again.history] == [1, 2, 3, 4]
    for step in (5, 6):  # the resumed run writes those steps again
        again.log_generations("train", [{"step": step, "index": i, "response": "y" * 500} for i in range(4)], step)
    rows = [r for p in reversed(again.generations["train"].parts()) for r in read_jsonl(p)]
    keys = [(r["step"], r["index"]) for r in rows]
    assert len(keys) == len(set(keys)) and keys[-8:] == [(s, i) for s in (5, 6) for i in range(4)]
    assert keys == sorted(keys)

    before = {p: p.stat().st_mtime_ns for p in again.generations["train"].parts()}
    again.resume_history(6)  # nothing after step 6: no file is rewritten
    assert {p: p.stat().st_mtime_ns for p in again.generations["train"].parts()} == before
    again.resume_history(-1)  # a fresh run in the directory: nothing of the earlier one is kept
    assert not any(read_jsonl(p) for p in again.generations["train"].parts())
    assert read_jsonl(run / "metrics.jsonl") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)")
def test_a_full_disk_ends_the_dump_with_one_error(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        tracker = Tracker(disk, sinks=["jsonl"], experiment="x", config={}, plot=False)
        with pytest.raises(RunFilesWriteFailed, match=r"step \d+: the run's files could not be written in .*disk is full"):
            for step in range(1, 1000):
                tracker.log_generations("train", [{"step": step, "index": i, "response": "z" * 500} for i in range(4)],
                                        step)
        tracker.close()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install -e .[wandb])")
def test_wandb_gets_a_table_of_the_first_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    tracker = Tracker(tmp_path, sinks=["wandb"], experiment="t", config={}, plot=False)
    tracker.log_generations("val", [{"step": 2, "index": i, "prompt": "p", "response": "r"} for i in range(6)], 2)
    tracker.close()
    assert read_jsonl(tmp_path / "generations" / "val.jsonl")[5]["index"] == 5
    assert list((tmp_path / "wandb").rglob("*.table.json"))


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed (pip install -e .[mlflow])")
def test_mlflow_gets_an_artifact_of_the_first_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    tracker = Tracker(tmp_path, sinks=["mlflow"], experiment="t", config={}, plot=False)
    tracker.log_generations("val", [{"step": 2, "index": i, "prompt": "p", "response": "r"} for i in range(6)], 2)
    tracker.close()
    (artifact,) = (tmp_path / "mlruns").rglob("step_000002.jsonl")
    assert [r["index"] for r in read_jsonl(artifact)] == list(range(SINK_ROWS))
