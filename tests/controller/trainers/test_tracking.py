"""curves.png: drawn at most every PLOT_EVERY_S while a run logs (never at its first log, which is
on the start-up's path), and at close()."""

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
