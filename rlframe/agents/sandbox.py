"""Running tool calls in a sandboxed worker process.

`ToolRunner(tools, max_result_chars=256)` starts one long-lived worker process (multiprocessing,
"spawn" by default) that loads the tools itself: built-ins by name, tools of a user's file by
importing the file again (their `source`), other tools unpickled. `run(calls)` executes the calls
of a batch one after another in that worker and returns one `ToolResult(text, status)` per call, in
order. Every failure becomes an observation text for the policy, never an exception:

    status         when                                           text
    ok             the tool returned                              its result (a str, else JSON, else str())
    malformed      the call did not parse (calls.MalformedCall)   error: malformed tool call (<reason>)
    unknown_tool   no tool has that name                          error: unknown tool 'x' (tools: ...)
    bad_arguments  the arguments do not fit the tool's schema     error: bad arguments for x: <why>
    error          the tool raised, ran out of memory, or         error: ZeroDivisionError: division by zero
                   killed its worker
    timeout        it ran past the tool's timeout_s               error: timed out after 2.0 s

Texts are cut to `max_result_chars` characters (in the worker already, so a huge result is not sent
through the pipe). Arguments are checked in the calling process (tools.check_arguments) before the
worker sees them.

Limits, per call: wall-clock `timeout_s` (the worker, and the process group it leads, is killed and a
new worker started right away, so it boots while the caller goes on; the next call waits until it is
ready); and `memory_mb` of address space the call may add to the worker (RLIMIT_AS, set before the
call and restored after; on Linux), so an allocation past it raises MemoryError inside the tool.
It limits address space, not resident memory: a tool that starts threads needs room for their stacks
and malloc arenas (tens of MB each).
These bound what a policy's arguments can make a tool do; the tool code itself is the run's own and
trusted. Like every spawned process, the worker imports the calling program's main module again
(multiprocessing's rule) before loading the tools; it does so once, and again only after a kill.
`counts` tallies the statuses of all calls for metrics; `close()` stops the worker.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlframe.agents.calls import MalformedCall, ToolCall
from rlframe.agents.tools import BUILTIN_SOURCE, BUILTIN_TOOLS, Tool, check_arguments, check_tool, load_tools

STATUSES = ("ok", "malformed", "unknown_tool", "bad_arguments", "error", "timeout")
TRUNCATION_MARKER = " ...[truncated]"


@dataclass(frozen=True)
class ToolResult:
    text: str
    status: str  # one of STATUSES


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters, ending with TRUNCATION_MARKER when cut."""
    if len(text) <= max_chars:
        return text
    if max_chars <= len(TRUNCATION_MARKER):
        return text[:max_chars]
    return text[:max_chars - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


def _error_text(exc: BaseException) -> str:
    msg = str(exc)
    return f"error: {type(exc).__name__}: {msg}" if msg else f"error: {type(exc).__name__}"


# ---------------------------------------------------------------------------------------- worker side


def _address_space() -> int | None:
    """Bytes of address space this process maps now (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _call(fn, arguments: dict, memory_mb: int, max_chars: int) -> tuple[str, str]:
    """Run one call in the worker: (status, text)."""
    import resource

    base = _address_space()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limited = False
    try:
        try:
            if base is not None:
                limit = base + memory_mb * 2**20
                if hard != resource.RLIM_INFINITY:
                    limit = min(limit, hard)
                resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
                limited = True
            text = truncate(_to_text(fn(**arguments)), max_chars)
        finally:
            if limited:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except MemoryError:
        return "error", f"error: MemoryError: the call exceeded its memory limit of {memory_mb} MB"
    except BaseException as exc:  # noqa: BLE001 - SystemExit and the like are the tool's errors too
        return "error", truncate(_error_text(exc), max_chars)
    return "ok", text


def _load_worker_tools(specs: Sequence[tuple[str, str | None, bytes | None]]) -> dict[str, Any]:
    fns: dict[str, Any] = {}
    files: dict[str, dict[str, Tool]] = {}
    for name, source, payload in specs:
        if source == BUILTIN_SOURCE:
            fns[name] = BUILTIN_TOOLS[name].fn
        elif source is not None:
            if source not in files:
                files[source] = load_tools(source, builtin=())
            if name not in files[source]:
                raise ValueError(f"tools file {source!r} no longer defines the tool {name!r}")
            fns[name] = files[source][name].fn
        else:
            fns[name] = pickle.loads(payload)
    return fns


def _worker_main(conn, specs, max_chars: int) -> None:
    """The tool worker: loads the tools, answers "ready", then runs one call per message
    (name, arguments, memory_mb) -> (status, text) until it gets None or its pipe closes."""
    try:
        os.setpgid(0, 0)  # its own process group: a kill on timeout takes whatever the tool started too
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the calling process, which stops the worker
    try:
        fns = _load_worker_tools(specs)
    except BaseException as exc:  # noqa: BLE001
        conn.send(("failed", f"the tool worker could not load the tools: {exc!r}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        name, arguments, memory_mb = msg
        status, text = _call(fns[name], arguments, memory_mb, max_chars)
        try:
            conn.send((status, text))
        except (OSError, ValueError):
            return


# ---------------------------------------------------------------------------------------- caller side


def _spec(t: Tool) -> tuple[str, str | None, bytes | None]:
    if t.source is not None:
        return t.name, t.source, None
    try:
        return t.name, None, pickle.dumps(t.fn)
    except Exception as exc:  # noqa: BLE001 - pickling fails in many ways
        raise ValueError(
            f"tool {t.name!r}: its fn cannot be sent to the tool worker process ({exc!r}); define it at module level "
            "of an importable module, or put it in a tools file loaded with load_tools (agent.tools_path)"
        ) from exc


class ToolRunner:
    """Executes tool calls in one sandboxed worker process (see the module docstring)."""

    def __init__(self, tools: Mapping[str, Tool], *, max_result_chars: int = 256, start_method: str = "spawn",
                 startup_timeout_s: float = 60.0):
        if max_result_chars <= 0:
            raise ValueError(f"max_result_chars must be positive, got {max_result_chars}")
        for key, t in tools.items():
            if key != t.name:
                raise ValueError(f"tool registered as {key!r} is named {t.name!r}; use load_tools() to build the registry")
            check_tool(t, where=f"tool {t.name!r}")
        self.tools = dict(tools)
        self.max_result_chars = max_result_chars
        self.startup_timeout_s = startup_timeout_s
        self.counts: Counter = Counter()
        self.restarts = 0  # workers started after the first (timeouts, crashes)
        self._specs = [_spec(t) for t in self.tools.values()]
        self._ctx = multiprocessing.get_context(start_method)
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None
        self._ready = False
        self._closed = False
        self._start()
        self._await_ready()

    # -- public

    def run(self, calls: Sequence[ToolCall | MalformedCall]) -> list[ToolResult]:
        """One result per call, in order; the calls run one after another in the worker."""
        with self._lock:
            if self._closed:
                raise RuntimeError("ToolRunner.run() after close()")
            results = [self._run_one(c) for c in calls]
            self.counts.update(r.status for r in results)
        return results

    def close(self) -> None:
        """Stop the worker (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._conn is not None and self._proc is not None and self._proc.is_alive():
                try:
                    self._conn.send(None)
                    self._proc.join(timeout=1.0)
                except (OSError, ValueError):
                    pass
            self._kill()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def worker_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # -- one call

    def _result(self, text: str, status: str) -> ToolResult:
        return ToolResult(text=truncate(text, self.max_result_chars), status=status)

    def _run_one(self, call: ToolCall | MalformedCall) -> ToolResult:
        if isinstance(call, MalformedCall):
            return self._result(f"error: malformed tool call ({call.reason})", "malformed")
        if not isinstance(call, ToolCall):
            raise TypeError(f"ToolRunner.run() takes ToolCall or MalformedCall items, got a {type(call).__name__}")
        t = self.tools.get(call.name)
        if t is None:
            return self._result(f"error: unknown tool {call.name!r} (tools: {', '.join(self.tools) or 'none'})",
                                "unknown_tool")
        why = check_arguments(t, call.arguments)
        if why is not None:
            return self._result(f"error: bad arguments for {t.name}: {why}", "bad_arguments")
        return self._execute(t, call.arguments)

    def _execute(self, t: Tool, arguments: dict) -> ToolResult:
        for attempt in range(2):
            self._ensure_ready()
            try:
                self._conn.send((t.name, arguments, t.memory_mb))
                break
            except (OSError, ValueError):  # the worker died between calls: start another, once
                self._restart()
                if attempt:
                    raise RuntimeError("the tool worker keeps dying before it receives a call") from None
        if not self._conn.poll(t.timeout_s):
            self._restart()
            return self._result(f"error: timed out after {float(t.timeout_s)} s", "timeout")
        try:
            status, text = self._conn.recv()
        except (EOFError, OSError):
            code = self._exitcode()
            self._restart()
            return self._result(f"error: the tool crashed its worker process (exit code {code})", "error")
        return self._result(text, status)

    # -- worker lifecycle

    def _start(self) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child, self._specs, self.max_result_chars),
                                 name="rlframe-tool-worker", daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn, self._ready = proc, parent, False

    def _await_ready(self) -> None:
        if not self._conn.poll(self.startup_timeout_s):
            self._kill()
            raise RuntimeError(f"the tool worker did not start within {self.startup_timeout_s} s")
        try:
            kind, msg = self._conn.recv()
        except (EOFError, OSError):
            code = self._exitcode()
            self._kill()
            raise RuntimeError(f"the tool worker exited while loading the tools (exit code {code})") from None
        if kind != "ready":
            self._kill()
            raise RuntimeError(msg)
        self._ready = True

    def _ensure_ready(self) -> None:
        if self._proc is None or not self._proc.is_alive():
            self._restart()
        if not self._ready:
            self._await_ready()

    def _restart(self) -> None:
        """Kill the worker and start a new one without waiting for it to load (the next call waits)."""
        self._kill()
        self._start()
        self.restarts += 1

    def _exitcode(self) -> int | None:
        if self._proc is None:
            return None
        self._proc.join(timeout=1.0)
        return self._proc.exitcode

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc, self._conn, self._ready = None, None, False
        if proc is not None:
            if proc.is_alive() and sys.platform != "win32":
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the worker leads its own group (see _worker_main)
                except OSError:
                    pass
            proc.kill()
            proc.join(timeout=5.0)
        if conn is not None:
            conn.close()
