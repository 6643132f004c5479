"""curves.png: drawn at most every PLOT_EVERY_S while a run logs (never at its first log, which is
on the start-up's path), and at close()."""

import os

import pytest

from rlframe.controller.trainers import tracking
from rlframe.controller.trainers.tracking import Tracker


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

    from rlframe.controller.trainers.tracking import RunFilesWriteFailed, Tracker

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
