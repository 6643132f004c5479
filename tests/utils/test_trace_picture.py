"""The trace drawn as a PNG (rlframe/utils/trace_picture.py), from a small trace the recorder wrote:
its lanes in order (driver first, then each group's ranks), nesting depths, a step window, notes."""

import time

import pytest

from rlframe.utils import trace
from rlframe.utils.trace_picture import Note, _nesting, lanes, main, render, step_window


@pytest.fixture()
def small_trace(tmp_path):
    """Two steps: driver phases, an actor group of 2 ranks and a rollout group of 1 whose generation
    of step 2's batch runs while step 1 trains."""
    rec = trace.open_trace(tmp_path)
    t0 = time.time()

    def call(group, method, start, seconds, ranks, spans=()):
        pending = rec.begin_call(group=group, role=group, method=method, bytes_in={r: 10 for r in ranks},
                                 submitted=start, compiled=False)
        pending.finish([(r, ("out", seconds, start, start + seconds, list(spans))) for r in ranks],
                       bytes_out=lambda out: 1)

    for step in (1, 2):
        s = t0 + (step - 1) * 1.0
        trace.at_step(step)
        rec.driver_span("gen", s, s + 0.3, {})
        rec.driver_span("update_actor", s + 0.4, s + 0.9, {})
        rec.driver_span("step", s, s + 0.95, {})
        call("rollout", "generate_sequences", s + 0.05, 0.2 if step == 1 else 0.1, [0],
             spans=[("gen_local", s + 0.06, s + 0.2)])
        call("actor", "update_actor", s + 0.4, 0.45, [0, 1])
    call("rollout", "generate_sequences", t0 + 0.35, 0.5, [0])  # step 2's batch, during step 1's update
    trace.interval("generation", t0 + 0.35, t0 + 1.1, lane="generation rounds", launched_at_step=1)
    trace.close_trace()
    return tmp_path / "trace.json"


def test_lanes_driver_first_then_ranks(small_trace):
    events = trace.read_trace(small_trace)
    labels = [label for _, _, label in lanes(events)]
    assert labels == ["driver/driver", "driver/generation rounds", "rollout/rank 0", "actor/rank 0", "actor/rank 1"]


def test_nesting():
    bars = [{"ts": 0, "dur": 10}, {"ts": 1, "dur": 3}, {"ts": 2, "dur": 1}, {"ts": 5, "dur": 2}, {"ts": 12, "dur": 1}]
    assert _nesting(bars) == ([0, 1, 2, 1, 0], {0, 1})


def test_render_a_png_with_notes_and_a_step_window(small_trace, tmp_path):
    import matplotlib.image

    events = trace.read_trace(small_trace)
    lo, hi = step_window(events, 2, 2)
    assert hi - lo == pytest.approx(0.95e6, abs=10)
    out = render(events, tmp_path / "img" / "timeline.png", title="small",
                 notes=[Note.parse("step1+0.4|rollout/rank 0|batch 2 generates while step 1 trains"),
                        Note.parse("0.1||step 1")])
    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 1000 and height > 200
    with pytest.raises(ValueError, match="no lane 'critic/rank 0'"):
        render(events, tmp_path / "x.png", notes=[Note(0.1, "critic/rank 0", "x")])
    with pytest.raises(ValueError, match="write it as WHEN"):
        Note.parse("0.4 rollout")
    note = Note.parse("step2+0.25|actor/rank 0|x")
    assert (note.step, note.seconds) == (2, 0.25)
    assert note.x(events, lo - 1e6) == pytest.approx(1.25)  # from a left edge 1 s before step 2
    assert Note.parse("step2|actor/rank 0|x").x(events, lo) == 0.0
    with pytest.raises(ValueError, match="no step 7"):
        step_window(events, 1, 7)


def test_command_line(small_trace, tmp_path, capsys):
    assert main([str(small_trace), "--out", str(tmp_path / "cli.png"), "--steps", "1-2",
                 "--note", "0.5|actor/rank 1|update"]) == 0
    assert (tmp_path / "cli.png").stat().st_size > 10_000
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli.png")
