"""A timeline of the run (trainer.trace=true): every worker group call per rank, the driver's phases,
weight pushes and generation rounds, as a Chrome trace (Trace Event Format) that opens in
ui.perfetto.dev or chrome://tracing.

Who records what:

    driver phases        `rlframe.utils.timing.timed` (gen, reward, ref, adv, update_actor, step, ...)
                         and `span(name)`: pid "driver", one tid per driver thread
    driver intervals     `interval(name, start, end, lane=...)`: spans that overlap each other or
                         cross steps (generation rounds in flight), one sub-lane per overlap
    group calls          single_controller/worker_group.py: one "X" event per called rank, pid = worker group,
                         tid = rank; args: method, role, step, bytes_in / bytes_out (the driver's
                         view of the arguments and the output), call (the same on every rank of a
                         call), queued_ms (the driver's submit to the rank's start)
    inside a call        `timed` / `span` in the worker process while it serves a traced call
                         (`collecting`): nested under the call's event on that rank

The file (`open_trace`) is JSON array format, one event per line: "[", events separated by commas,
"]" at `close`. It is appended to at every `flush` (the trainer flushes after each step), so a run
that dies leaves the events of its finished steps: Perfetto and chrome://tracing read an array
without its closing bracket, and `read_trace` here reads such a file too. Times are wall clock
(microseconds since the epoch), the workers' clocks as they are (several hosts: as synchronised as
their NTP). Each driver process of a run writes its own file: trace.json, then trace.1.json,
trace.2.json, ... for each process that resumes the run (a restart of the worker groups within one
process keeps writing the same file).

Off (no recorder), `span` returns a shared no-op context and group calls send and return exactly
what they do without tracing.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

DRIVER = "driver"
_NULL = contextlib.nullcontext()

_recorder: "TraceRecorder | None" = None  # the driver's, while a traced run is open
_collector: list | None = None  # a worker's, while it serves a traced call


def current() -> "TraceRecorder | None":
    """The driver's recorder while a traced run is open, else None."""
    return _recorder


def trace_path(run_dir: Path) -> Path:
    """trace.json, or trace.<n>.json with the lowest n not taken (a resumed run's own file)."""
    run_dir = Path(run_dir)
    path, n = run_dir / "trace.json", 0
    while path.exists():
        n += 1
        path = run_dir / f"trace.{n}.json"
    return path


def open_trace(run_dir: Path) -> "TraceRecorder":
    """Start recording this driver's run into a new file of `run_dir` (`trace_path`)."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError(f"a trace is being recorded already ({_recorder.path}); close it first")
    _recorder = TraceRecorder(trace_path(run_dir))
    return _recorder


def close_trace() -> None:
    """Write what is buffered and the closing bracket; recording stops (also when the write fails)."""
    global _recorder
    rec, _recorder = _recorder, None
    if rec is not None:
        rec.close()


def flush() -> None:
    if _recorder is not None:
        _recorder.flush()


def at_step(step: int) -> None:
    """The driver starts step `step`: later events carry it (args.step)."""
    if _recorder is not None:
        _recorder.step = step


def span(name: str, **args):
    """`with span("push_weights"): ...` records the block: a driver phase, or a span inside the
    traced call a worker serves. A no-op context when neither records."""
    if _recorder is None and _collector is None:
        return _NULL
    return _Span(name, args)


def interval(name: str, start: float, end: float, *, lane: str, **args) -> None:
    """A driver interval (wall clock seconds) on `lane` (a sub-lane per interval it overlaps)."""
    if _recorder is not None:
        _recorder.interval(name, start, end, lane=lane, args=args)


@contextlib.contextmanager
def collecting():
    """In a worker serving a traced call: the (name, start, end) of every `span`/`timed` inside it."""
    global _collector
    outer, _collector = _collector, []
    try:
        yield _collector
    finally:
        _collector = outer


class _Span:
    __slots__ = ("name", "args", "start")

    def __init__(self, name: str, args: dict):
        self.name, self.args = name, args

    def __enter__(self):
        self.start = time.time()
        return self

    def __exit__(self, *exc):
        end = time.time()
        if _collector is not None:
            _collector.append((self.name, self.start, end))
        elif _recorder is not None:
            _recorder.driver_span(self.name, self.start, end, self.args)
        return False


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


class PendingCall:
    """A traced group call between its submission and its answers (`finish`)."""

    __slots__ = ("recorder", "group", "role", "method", "bytes_in", "submitted", "step", "call", "compiled")

    def __init__(self, recorder: "TraceRecorder", *, group: str, role: str, method: str, bytes_in: dict[int, int],
                 submitted: float, compiled: bool):
        self.recorder, self.group, self.role, self.method = recorder, group, role, method
        self.bytes_in, self.submitted, self.compiled = bytes_in, submitted, compiled
        self.step, self.call = recorder.step, recorder.next_call()

    def finish(self, answers: list[tuple[int, tuple]], bytes_out) -> None:
        """`answers`: (rank, the rank's stamped answer (output, seconds, start, end, spans)) of every
        called rank; `bytes_out(output)` sizes an output."""
        if self.recorder.closed:
            return
        name = self.method if self.role == self.group else f"{self.role}.{self.method}"
        for rank, answer in answers:
            if len(answer) < 5:  # not stamped (cannot happen for a call submitted while tracing)
                continue
            out, _, start, end, spans = answer
            args = {"method": self.method, "role": self.role, "step": self.step, "call": self.call,
                    "bytes_in": self.bytes_in.get(rank, 0), "bytes_out": bytes_out(out),
                    "queued_ms": round(1e3 * (start - self.submitted), 3), "compiled": self.compiled}
            self.recorder.complete(name, group=self.group, tid=rank, start=start, end=end, cat="call", args=args)
            for span_name, s, e in spans:
                self.recorder.complete(span_name, group=self.group, tid=rank, start=s, end=e, cat="worker",
                                       args={"call": self.call, "step": self.step})


class TraceRecorder:
    """Events in memory until `flush` appends them to `path` (created with "[" at once)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.step = 0
        self.closed = False
        self.opened = time.time()
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[int, object], int] = {}  # (pid, key) -> tid
        self._lanes: dict[str, list[float]] = {}  # driver lane -> each sub-lane's last end
        self._calls = 0
        self._written = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("[\n")
        self._pid(DRIVER)
        self._tid(self._pids[DRIVER], threading.main_thread().ident, DRIVER)

    def next_call(self) -> int:
        with self._lock:
            self._calls += 1
            return self._calls

    def begin_call(self, *, group: str, role: str, method: str, bytes_in: dict[int, int], submitted: float,
                   compiled: bool) -> PendingCall:
        return PendingCall(self, group=group, role=role, method=method, bytes_in=bytes_in, submitted=submitted,
                           compiled=compiled)

    # ---- events --------------------------------------------------------------------------------
    def _pid(self, group: str) -> int:
        pid = self._pids.get(group)
        if pid is None:
            pid = self._pids[group] = len(self._pids) + 1
            self._events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": group}})
            self._events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                                 "args": {"sort_index": pid}})
        return pid

    def _tid(self, pid: int, key, name: str) -> int:
        tid = self._tids.get((pid, key))
        if tid is None:
            tid = key if isinstance(key, int) and pid != self._pids[DRIVER] else \
                sum(1 for p, _ in self._tids if p == pid)
            self._tids[(pid, key)] = tid
            self._events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            self._events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                                 "args": {"sort_index": tid}})
        return tid

    def complete(self, name: str, *, group: str, tid: int, start: float, end: float, cat: str, args: dict) -> None:
        """An "X" event on rank `tid` of `group` (wall clock seconds)."""
        with self._lock:
            pid = self._pid(group)
            tid = self._tid(pid, tid, f"rank {tid}")
            self._events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": _us(start),
                                 "dur": _us(max(0.0, end - start)), "args": args})

    def driver_span(self, name: str, start: float, end: float, args: dict) -> None:
        thread = threading.current_thread()
        with self._lock:
            pid = self._pids[DRIVER]
            tid = self._tid(pid, thread.ident, DRIVER if thread is threading.main_thread() else thread.name)
            self._events.append({"ph": "X", "name": name, "cat": "phase", "pid": pid, "tid": tid, "ts": _us(start),
                                 "dur": _us(max(0.0, end - start)), "args": {"step": self.step, **args}})

    def interval(self, name: str, start: float, end: float, *, lane: str, args: dict) -> None:
        """On the first sub-lane of `lane` free since `start`: intervals are recorded when they end, so
        one that overlaps an earlier-recorded one gets a lane of its own (complete events on one
        lane must nest)."""
        with self._lock:
            ends = self._lanes.setdefault(lane, [])
            i = next((i for i, e in enumerate(ends) if e <= start), len(ends))
            if i == len(ends):
                ends.append(end)
            ends[i] = max(ends[i], end)
            pid = self._pids[DRIVER]
            tid = self._tid(pid, (lane, i), lane if i == 0 else f"{lane} ({i + 1})")
            self._events.append({"ph": "X", "name": name, "cat": lane, "pid": pid, "tid": tid, "ts": _us(start),
                                 "dur": _us(max(0.0, end - start)), "args": {"step": self.step, **args}})

    # ---- the file ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Append the buffered events (one per line); OSError (a full disk) propagates."""
        with self._lock:
            events, self._events = self._events, []
        if not events or self.closed:
            return
        lines = [json.dumps(e, separators=(",", ":")) for e in events]
        text = ("" if self._written == 0 else ",\n") + ",\n".join(lines)
        with self.path.open("a") as f:
            f.write(text)
        self._written += len(lines)

    def close(self) -> None:
        if self.closed:
            return
        if threading.current_thread() is threading.main_thread():  # the whole run, around every phase
            self.driver_span("run", self.opened, time.time(), {})
        try:
            self.flush()
        finally:
            self.closed = True
        with self.path.open("a") as f:
            f.write("\n]\n")


def read_trace(path: Path) -> list[dict]:
    """The events of a trace file, also of one a run that died left (no closing bracket, or a last
    line cut short: its complete events are read)."""
    events = []
    for line in Path(path).read_text().splitlines():
        line = line.strip().strip(",")
        if not line.startswith("{"):
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written when the run died
            continue
    return events
