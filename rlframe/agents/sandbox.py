"""Running tool calls in a sandboxed worker process: a resource limit, not a security boundary.

`ToolRunner(tools, max_result_chars=256)` starts one long-lived worker process (multiprocessing,
"spawn" by default) that loads the tools itself: built-ins by name, tools of a user's file by
importing the file again (their `source`), other tools unpickled. `run(calls)` executes the calls
of a batch one after another and returns one `ToolResult(text, status, seconds)` per call, in
order. Every failure becomes an observation text for the policy, never an exception:

    status          when                                          text
    ok              the tool returned                             its result (a str, else JSON, else str())
    malformed       the call did not parse (calls.MalformedCall)  error: malformed tool call (<reason>)
    unknown_tool    no tool has that name                         error: unknown tool 'x' (tools: ...)
    bad_arguments   the arguments do not fit the tool's schema    error: bad arguments for x: <why>
    too_many_calls  past agent.max_calls_per_turn (ExcessCall)    error: call not run: at most 8 tool calls ...
    error           the tool raised, ran out of memory or CPU     error: ZeroDivisionError: division by zero
                    time, or its process died
    timeout         it ran past the tool's timeout_s              error: timed out after 2.0 s

Texts are cut to `max_result_chars` characters (before they leave the call's process). Arguments are
checked in the calling process (tools.check_arguments) before the worker sees them.

Each call runs in a process of its own, forked from the worker, in a new session, under hard limits
(soft = hard, so the tool cannot raise them; a root worker also drops CAP_SYS_RESOURCE first):
  - RLIMIT_AS: the worker's address space plus the tool's `memory_mb` (an allocation past it raises
    MemoryError in the tool; it limits address space, not resident memory: a tool that starts
    threads needs room for their stacks and malloc arenas, tens of MB each);
  - RLIMIT_CPU: `cpu_s` (default timeout_s) seconds of CPU time, SIGXCPU then SIGKILL a second later;
    every process the tool starts inherits these limits;
  - wall clock: past `timeout_s` the worker kills the call's process and everything it started.
"Everything it started" (Linux): the worker is a child subreaper (prctl), so processes the tool
starts stay below it in the process tree even when they start a new session or their parent exits;
after every call the worker SIGKILLs all of them, found in /proc, until none is left (processes the
tools file started when it was imported are spared). Elsewhere only the call's process group is
killed. If the worker itself stops answering (timeout_s plus `kill_grace_s`), the caller kills the
worker's whole tree the same way and starts another.

Between the processes only plain data travels: JSON, never pickle. The caller reads the worker's
replies as bytes of bounded size and accepts only a [status, text] pair of a known status and a
string; anything else is a broken worker (killed, restarted, the call's result an error). A call's
process does not keep the worker's pipe to the caller.

What this bounds is what a policy's arguments can make the run's own tools do; the tool code itself
is the user's and trusted: it runs with the run's user, files and network, and it is not confined.
Like every spawned process, the worker imports the calling program's main module again
(multiprocessing's rule) before loading the tools; it does so once, and again only after a kill.
`counts` tallies the statuses of all calls for metrics; `close()` stops the worker and its tree.
The worker's side (the wire format, the call processes and their limits) is tool_worker.py.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rlframe.agents.calls import ExcessCall, MalformedCall, ToolCall
from rlframe.agents.process_limits import kill_descendants
from rlframe.agents.tool_worker import (LINUX, TRUNCATION_MARKER, WORKER_STATUSES, decode_json, decode_reply,
                                        encode, max_reply_bytes, truncate, worker_main)
from rlframe.agents.tools import Tool, check_arguments, check_tool, cpu_seconds

__all__ = ["STATUSES", "TRUNCATION_MARKER", "WORKER_STATUSES", "ToolResult", "ToolRunner", "decode_reply", "encode",
           "truncate"]

STATUSES = ("ok", "malformed", "unknown_tool", "bad_arguments", "too_many_calls", "error", "timeout")


@dataclass(frozen=True)
class ToolResult:
    text: str
    status: str  # one of STATUSES
    seconds: float = field(default=0.0, compare=False)  # wall-clock time of the call; 0 when nothing ran


# ------------------------------------------------------------------------------------- caller side


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
                 startup_timeout_s: float = 60.0, kill_grace_s: float = 5.0):
        if max_result_chars <= 0:
            raise ValueError(f"max_result_chars must be positive, got {max_result_chars}")
        for key, t in tools.items():
            if key != t.name:
                raise ValueError(f"tool registered as {key!r} is named {t.name!r}; use load_tools() to build the registry")
            check_tool(t, where=f"tool {t.name!r}")
        self.tools = dict(tools)
        self.max_result_chars = max_result_chars
        self.startup_timeout_s = startup_timeout_s
        self.kill_grace_s = kill_grace_s  # past timeout_s, how long the worker may take to answer
        self.counts: Counter = Counter()
        self.restarts = 0  # workers started after the first (a worker that hung, died or sent garbage)
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

    def run(self, calls: Sequence[ToolCall | MalformedCall | ExcessCall]) -> list[ToolResult]:
        """One result per call, in order; the calls run one after another."""
        with self._lock:
            if self._closed:
                raise RuntimeError("ToolRunner.run() after close()")
            results = [self._run_one(c) for c in calls]
            self.counts.update(r.status for r in results)
        return results

    def close(self) -> None:
        """Stop the worker and everything below it (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._conn is not None and self._proc is not None and self._proc.is_alive():
                try:
                    self._conn.send_bytes(encode(None))
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

    def _result(self, text: str, status: str, seconds: float = 0.0) -> ToolResult:
        return ToolResult(text=truncate(text, self.max_result_chars), status=status, seconds=seconds)

    def _run_one(self, call: ToolCall | MalformedCall | ExcessCall) -> ToolResult:
        if isinstance(call, ExcessCall):
            return self._result(f"error: call not run: at most {call.limit} tool calls per turn run; make fewer "
                                "calls in one turn", "too_many_calls")
        if isinstance(call, MalformedCall):
            return self._result(f"error: malformed tool call ({call.reason})", "malformed")
        if not isinstance(call, ToolCall):
            raise TypeError(f"ToolRunner.run() takes ToolCall, MalformedCall or ExcessCall items, got a "
                            f"{type(call).__name__}")
        t = self.tools.get(call.name)
        if t is None:
            return self._result(f"error: unknown tool {call.name!r} (tools: {', '.join(self.tools) or 'none'})",
                                "unknown_tool")
        why = check_arguments(t, call.arguments)
        if why is not None:
            return self._result(f"error: bad arguments for {t.name}: {why}", "bad_arguments")
        try:
            msg = encode({"name": t.name, "arguments": call.arguments, "timeout_s": float(t.timeout_s),
                          "memory_mb": t.memory_mb, "cpu_s": cpu_seconds(t)})
        except (TypeError, ValueError) as exc:
            return self._result(f"error: bad arguments for {t.name}: not JSON ({exc})", "bad_arguments")
        start = time.monotonic()
        status, text = self._execute(t, msg)
        return self._result(text, status, time.monotonic() - start)

    def _execute(self, t: Tool, msg: bytes) -> tuple[str, str]:
        self._send(msg)
        if not self._conn.poll(t.timeout_s + self.kill_grace_s):
            self._restart()  # the worker did not end the call itself: its whole tree goes
            return "timeout", f"error: timed out after {float(t.timeout_s)} s"
        try:
            return decode_reply(self._conn.recv_bytes(max_reply_bytes(self.max_result_chars)), WORKER_STATUSES)
        except (EOFError, OSError) as exc:
            code = self._exitcode()
            self._restart()
            return "error", f"error: the tool worker process failed during the call (exit code {code}; {exc!r})"
        except ValueError as exc:
            self._restart()
            return "error", f"error: the tool worker sent a reply that is not plain data ({exc}); it was restarted"

    def _send(self, msg: bytes) -> None:
        for attempt in range(2):
            self._ensure_ready()
            try:
                self._conn.send_bytes(msg)
                return
            except (OSError, ValueError):  # the worker died between calls: start another, once
                self._restart()
                if attempt:
                    raise RuntimeError("the tool worker keeps dying before it receives a call") from None

    # -- worker lifecycle

    def _start(self) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=worker_main, args=(child, self._specs, self.max_result_chars),
                                 name="rlframe-tool-worker", daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn, self._ready = proc, parent, False

    def _await_ready(self) -> None:
        if not self._conn.poll(self.startup_timeout_s):
            self._kill()
            raise RuntimeError(f"the tool worker did not start within {self.startup_timeout_s} s")
        try:
            kind, msg = _decode_hello(self._conn.recv_bytes(65536))
        except (EOFError, OSError):
            code = self._exitcode()
            self._kill()
            raise RuntimeError(f"the tool worker exited while loading the tools (exit code {code})") from None
        except ValueError as exc:
            self._kill()
            raise RuntimeError(f"the tool worker's start-up message is not plain data ({exc}); something in "
                               "the worker (a tools file's import) wrote to its pipe") from None
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
        """Kill the worker and every process below it; nothing it started outlives it."""
        proc, conn = self._proc, self._conn
        self._proc, self._conn, self._ready = None, None, False
        if proc is not None:
            if proc.is_alive() and sys.platform != "win32":
                _kill_worker_tree(proc.pid)
            proc.kill()
            proc.join(timeout=5.0)
        if conn is not None:
            conn.close()


def _decode_hello(data: bytes) -> tuple[str, str | None]:
    """The worker's first message: ["ready", null] or ["failed", why]."""
    obj = decode_json(data)
    if obj == ["ready", None] or (isinstance(obj, list) and len(obj) == 2 and obj[0] == "failed"
                                  and isinstance(obj[1], str)):
        return obj[0], obj[1]
    raise ValueError(f'not ["ready", null] or ["failed", why] (got {str(obj)[:80]})')


def _kill_worker_tree(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGSTOP)  # it starts no new process while its tree is killed
    except OSError:
        return
    if LINUX:
        kill_descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)  # the worker leads its own group (see worker_main)
    except OSError:
        pass
