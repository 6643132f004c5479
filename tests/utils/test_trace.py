"""The run's timeline (rlframe/utils/trace.py): Chrome trace events that json.load reads, named
processes and threads, driver phases nested as they ran, a call's ranks with their inner spans,
overlapping intervals on lanes of their own, a file readable after a crash, and nothing recorded
(nor any object made) when off."""

import json
import time

import pytest

from rlframe.utils import trace
from rlframe.utils.timing import timed


@pytest.fixture()
def recorder(tmp_path):
    rec = trace.open_trace(tmp_path)
    yield rec
    trace.close_trace()


def _x(events, name=None):
    return [e for e in events if e["ph"] == "X" and (name is None or e["name"] == name)]


def _meta(events, kind):
    return {(e["pid"], e["tid"]) if kind == "thread_name" else e["pid"]: e["args"]["name"]
            for e in events if e["ph"] == "M" and e["name"] == kind}


def _inside(inner, outer):
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def _stamped(start, seconds, spans=()):
    """A rank's answer to a traced call (WorkerHost.call with stamp=True)."""
    return ("out", seconds, start, start + seconds, list(spans))


def test_events_are_a_chrome_trace_with_named_lanes_and_nesting(recorder, tmp_path):
    trace.at_step(3)
    timing = {}
    with timed(timing, "step"):
        with timed(timing, "gen"):
            time.sleep(0.002)
        submitted = time.time()
        call = recorder.begin_call(group="actor", role="actor", method="update_actor", bytes_in={0: 100, 1: 120},
                                   submitted=submitted, compiled=False)
        t = time.time()
        time.sleep(0.012)  # the ranks' answers arrive after they ended
        call.finish([(0, _stamped(t, 0.01, [("fetch_args", t, t + 0.001)])), (1, _stamped(t + 0.001, 0.008))],
                    bytes_out=lambda out: 7)
    assert set(timing) == {"timing_s/step", "timing_s/gen"}  # the timers still time
    trace.close_trace()

    events = json.load(open(tmp_path / "trace.json"))  # closed: plain JSON
    for e in events:
        assert {"ph", "name", "pid", "tid"} <= set(e)
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and e["dur"] >= 0 and isinstance(e["args"], dict)
    procs = _meta(events, "process_name")
    assert sorted(procs.values()) == ["actor", "driver"]
    driver = next(p for p, n in procs.items() if n == "driver")
    actor = next(p for p, n in procs.items() if n == "actor")
    assert _meta(events, "thread_name")[(actor, 0)] == "rank 0" and _meta(events, "thread_name")[(actor, 1)] == "rank 1"
    [step], [gen], [run] = _x(events, "step"), _x(events, "gen"), _x(events, "run")
    assert step["pid"] == gen["pid"] == driver and step["args"]["step"] == 3 and gen["tid"] == step["tid"]
    assert _inside(gen, step) and _inside(step, run)
    calls = _x(events, "update_actor")
    assert sorted(e["tid"] for e in calls) == [0, 1] and {e["pid"] for e in calls} == {actor}
    by_rank = {e["tid"]: e for e in calls}
    assert by_rank[0]["args"] == {"method": "update_actor", "role": "actor", "step": 3, "call": 1, "bytes_in": 100,
                                  "bytes_out": 7, "queued_ms": pytest.approx(1e3 * (t - submitted), abs=0.01),
                                  "compiled": False}
    assert by_rank[1]["args"]["bytes_in"] == 120 and by_rank[1]["dur"] == pytest.approx(8000, abs=1)
    [fetch] = _x(events, "fetch_args")
    assert fetch["tid"] == 0 and fetch["pid"] == actor and _inside(fetch, by_rank[0]) and fetch["args"]["call"] == 1
    assert all(_inside(e, step) for e in calls)


def test_colocated_role_calls_are_named_by_role(recorder, tmp_path):
    recorder.begin_call(group="hybrid", role="critic", method="compute_values", bytes_in={0: 1}, submitted=time.time(),
                        compiled=True).finish([(0, _stamped(time.time(), 0.001))], bytes_out=lambda out: 0)
    trace.close_trace()
    [e] = _x(json.load(open(tmp_path / "trace.json")), "critic.compute_values")
    assert e["args"]["role"] == "critic" and e["args"]["compiled"] is True


def test_overlapping_intervals_get_lanes_of_their_own(recorder, tmp_path):
    t = time.time()
    trace.interval("generation", t + 1, t + 2, lane="generation rounds", launched_at_step=1)  # ends first
    trace.interval("generation", t, t + 3, lane="generation rounds", launched_at_step=1)  # overlaps it
    trace.interval("generation", t + 3, t + 4, lane="generation rounds", launched_at_step=2)  # after both
    trace.close_trace()
    events = json.load(open(tmp_path / "trace.json"))
    gens = _x(events, "generation")
    names = _meta(events, "thread_name")
    lanes = [names[(e["pid"], e["tid"])] for e in gens]
    assert lanes == ["generation rounds", "generation rounds (2)", "generation rounds"]
    for a in gens:  # complete events on one lane never overlap
        for b in gens:
            if a is not b and a["tid"] == b["tid"]:
                assert a["ts"] + a["dur"] <= b["ts"] or b["ts"] + b["dur"] <= a["ts"]


def test_driver_threads_have_lanes_of_their_own(recorder, tmp_path):
    import threading

    def work():
        with trace.span("score_chunk"):
            pass

    thread = threading.Thread(target=work, name="reward-pool-0")
    with trace.span("reward"):
        thread.start()
        thread.join()
    trace.close_trace()
    events = json.load(open(tmp_path / "trace.json"))
    names = _meta(events, "thread_name")
    [chunk], [reward] = _x(events, "score_chunk"), _x(events, "reward")
    assert names[(chunk["pid"], chunk["tid"])] == "reward-pool-0" and names[(reward["pid"], reward["tid"])] == "driver"


def test_a_run_that_dies_leaves_a_readable_trace(recorder, tmp_path):
    with trace.span("step"):
        pass
    trace.flush()  # the tracker flushes after every step; then the process is killed
    with trace.span("gen"):
        pass
    text = (tmp_path / "trace.json").read_text()
    assert not text.rstrip().endswith("]")
    assert [e["name"] for e in _x(json.loads(text + "]"))] == ["step"]  # what Perfetto reads
    (tmp_path / "trace.json").write_text(text + ',\n{"ph":"X","name":"cut sh')  # killed mid-write
    assert [e["name"] for e in _x(trace.read_trace(tmp_path / "trace.json"))] == ["step"]


def test_a_resumed_run_writes_its_own_file(tmp_path):
    assert trace.trace_path(tmp_path) == tmp_path / "trace.json"
    (tmp_path / "trace.json").write_text("[\n]\n")
    (tmp_path / "trace.1.json").write_text("[\n]\n")
    rec = trace.open_trace(tmp_path)
    try:
        assert rec.path == tmp_path / "trace.2.json"
        with pytest.raises(RuntimeError, match="being recorded already"):
            trace.open_trace(tmp_path)
    finally:
        trace.close_trace()
    assert (tmp_path / "trace.json").read_text() == "[\n]\n"  # the earlier process's file is kept


def test_off_records_nothing():
    assert trace.current() is None
    assert trace.span("gen") is trace.span("adv")  # one shared no-op context, nothing made per phase
    timing = {}
    with timed(timing, "gen"):
        pass
    trace.at_step(5)
    trace.interval("generation", 0.0, 1.0, lane="x")
    trace.flush()
    assert "timing_s/gen" in timing and trace.current() is None


def test_a_worker_collects_the_spans_of_the_call_it_serves():
    with trace.collecting() as spans:
        timing = {}
        with timed(timing, "update_weights"):
            with trace.span("inner"):
                pass
    assert [name for name, _, _ in spans] == ["inner", "update_weights"]
    assert all(start <= end for _, start, end in spans)
    with timed({}, "after"):  # outside a traced call nothing is collected
        pass
    assert len(spans) == 2
