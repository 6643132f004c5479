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
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import pickle
import select
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlframe.agents.calls import ExcessCall, MalformedCall, ToolCall
from rlframe.agents.process_limits import (descendants, drop_resource_capability, kill_descendants,
                                           prctl, reap_children, set_limits)
from rlframe.agents.tools import (BUILTIN_SOURCE, BUILTIN_TOOLS, Tool, check_arguments, check_tool, cpu_seconds,
                                  load_tools)

STATUSES = ("ok", "malformed", "unknown_tool", "bad_arguments", "too_many_calls", "error", "timeout")
WORKER_STATUSES = ("ok", "error", "timeout")  # the statuses a worker's reply may carry
TRUNCATION_MARKER = " ...[truncated]"
_CALL_STATUSES = ("ok", "error")  # what a call's process may report
_LINUX = sys.platform.startswith("linux") and os.path.isdir("/proc/self")
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class ToolResult:
    text: str
    status: str  # one of STATUSES
    seconds: float = field(default=0.0, compare=False)  # wall-clock time of the call; 0 when nothing ran


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


# ------------------------------------------------------------------------------ plain data on the pipes


def encode(obj: Any) -> bytes:
    """JSON bytes (ASCII: any str, lone surrogates included, survives the trip)."""
    return json.dumps(obj, ensure_ascii=True).encode("ascii")


def decode_reply(data: bytes, statuses: Sequence[str]) -> tuple[str, str]:
    """(status, text) from a reply that must be the JSON array [status, text], status one of
    `statuses` and text a string; ValueError saying what is wrong with anything else."""
    try:
        obj = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__}; starts with {bytes(data[:16])!r})") from None
    if not (isinstance(obj, list) and len(obj) == 2 and obj[0] in statuses and isinstance(obj[1], str)):
        raise ValueError(f"not a [status, text] pair with a status in {list(statuses)} (got {str(obj)[:80]})")
    return obj[0], obj[1]


def _max_reply_bytes(max_chars: int) -> int:
    return 12 * max_chars + 1024  # ASCII JSON: at most 12 bytes per character (an escaped surrogate pair)


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _call(fn, arguments: dict, memory_mb: int, max_chars: int) -> tuple[str, str]:
    """Run the tool: (status, text)."""
    try:
        return "ok", truncate(_to_text(fn(**arguments)), max_chars)
    except MemoryError:
        return "error", f"error: MemoryError: the call exceeded its memory limit of {memory_mb} MB"
    except BaseException as exc:  # noqa: BLE001 - SystemExit and the like are the tool's errors too
        return "error", truncate(_error_text(exc), max_chars)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _call_process(fn, msg: dict, max_chars: int, out_fd: int, conn) -> None:
    """The body of a call's process (a fork of the worker): never returns."""
    code = 0
    oom = encode(["error", f"error: MemoryError: the call exceeded its memory limit of {msg['memory_mb']} MB"])
    try:
        try:
            conn.close()  # the worker's pipe to the caller: not the tool's to write to
            os.setsid()
            drop_resource_capability()
            set_limits(msg["memory_mb"], msg["cpu_s"])
        except Exception as exc:  # noqa: BLE001 - no call runs without its limits
            reply = encode(["error", f"error: the sandbox could not limit the call's process: {exc!r}"])
        else:
            reply = encode(list(_call(fn, msg["arguments"], msg["memory_mb"], max_chars)))
        _write_all(out_fd, reply)
    except MemoryError:
        _write_all(out_fd, oom)
    except BaseException:  # noqa: BLE001 - whatever happens, this process must not return into the worker
        code = 70
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(code)


# ------------------------------------------------------------------------------------- worker side


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _drain(fd: int, buf: bytearray, limit: int) -> None:
    os.set_blocking(fd, False)
    try:
        while len(buf) <= limit and (chunk := os.read(fd, 65536)):
            buf += chunk
    except BlockingIOError:
        pass


def _wait_call(pid: int, fd: int, timeout_s: float, limit: int) -> tuple[bytes, int | None]:
    """Read what the call's process `pid` writes to `fd` until it exits: (bytes, its wait status), or
    (bytes, None) when it is still running after `timeout_s`. At most `limit` bytes are kept."""
    deadline = time.monotonic() + timeout_s
    buf, readable, pidfd = bytearray(), True, _pidfd(pid)
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _drain(fd, buf, limit)
                return bytes(buf), status
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(buf), None
            waits = [fd] * readable + ([pidfd] if pidfd is not None else [])
            ready = select.select(waits, [], [], left if pidfd is not None else min(left, 0.005))[0]
            if fd in ready:
                chunk = os.read(fd, 65536)
                readable = bool(chunk)  # EOF: wait for the exit alone
                if len(buf) <= limit:
                    buf += chunk
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _died_text(status: int, msg: dict) -> str:
    """What the policy reads when the call's process ended without a result."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        cpu = max(1, math.ceil(msg["cpu_s"]))
        if sig == signal.SIGXCPU:
            return f"error: the call used up its CPU time limit of {cpu} s"
        if sig == signal.SIGKILL:
            return f"error: the tool's process was killed (past its CPU time limit of {cpu} s, or out of memory)"
        return f"error: the tool's process was killed by {signal.Signals(sig).name}"
    return f"error: the tool's process exited with code {os.waitstatus_to_exitcode(status)} without a result"


def _end_call(pid: int, keep: frozenset[int]) -> None:
    """Kill the call's process, if it still runs, and every process it started; collect them."""
    if not _LINUX:
        try:
            os.killpg(pid, signal.SIGKILL)  # its session's first group: what it started there
        except OSError:
            pass
    if reap_children() and _LINUX:
        kill_descendants(os.getpid(), exclude=keep, reap=True)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _run_call(fn, msg: dict, max_chars: int, conn, keep: frozenset[int]) -> tuple[str, str]:
    """One call in a process of its own: (status, text)."""
    try:
        r, w = os.pipe()
    except OSError as exc:
        return "error", f"error: the call's process could not be started ({exc})"
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(r)
        os.close(w)
        return "error", f"error: the call's process could not be started ({exc})"
    if pid == 0:
        os.close(r)
        _call_process(fn, msg, max_chars, w, conn)
    os.close(w)
    try:
        data, status = _wait_call(pid, r, msg["timeout_s"], _max_reply_bytes(max_chars))
    finally:
        os.close(r)
        _end_call(pid, keep)
    if status is None:
        return "timeout", f"error: timed out after {float(msg['timeout_s'])} s"
    try:
        return decode_reply(data, _CALL_STATUSES)
    except ValueError:
        return "error", _died_text(status, msg)


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
            fns[name] = pickle.loads(payload)  # sent by the caller, which trusts its own tools
    return fns


def _worker_main(conn, specs, max_chars: int) -> None:
    """The tool worker: loads the tools, answers ["ready", null], then runs one call per message
    {name, arguments, timeout_s, memory_mb, cpu_s} -> [status, text], all JSON, until it gets null or
    its pipe closes; then it kills whatever is left below it."""
    try:
        os.setpgid(0, 0)  # its own process group (the caller's fallback kill where there is no /proc)
    except OSError:
        pass
    prctl(_PR_SET_CHILD_SUBREAPER, 1)  # what a tool starts stays below the worker, whatever it does
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the calling process, which stops the worker
    try:
        fns = _load_worker_tools(specs)
    except BaseException as exc:  # noqa: BLE001
        conn.send_bytes(encode(["failed", f"the tool worker could not load the tools: {exc!r}"]))
        return
    keep = frozenset(descendants(os.getpid())) if _LINUX else frozenset()  # started by the tools files
    conn.send_bytes(encode(["ready", None]))
    try:
        _serve(conn, fns, max_chars, keep)
    finally:
        if _LINUX:
            kill_descendants(os.getpid(), reap=True)


def _serve(conn, fns: dict[str, Any], max_chars: int, keep: frozenset[int]) -> None:
    while True:
        try:
            msg = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if msg is None:
            return
        reply = _run_call(fns[msg["name"]], msg, max_chars, conn, keep)
        try:
            conn.send_bytes(encode(list(reply)))
        except (OSError, ValueError):
            return


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
            return decode_reply(self._conn.recv_bytes(_max_reply_bytes(self.max_result_chars)), WORKER_STATUSES)
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
    try:
        obj = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__}; starts with {bytes(data[:16])!r})") from None
    if obj == ["ready", None] or (isinstance(obj, list) and len(obj) == 2 and obj[0] == "failed"
                                  and isinstance(obj[1], str)):
        return obj[0], obj[1]
    raise ValueError(f'not ["ready", null] or ["failed", why] (got {str(obj)[:80]})')


def _kill_worker_tree(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGSTOP)  # it starts no new process while its tree is killed
    except OSError:
        return
    if _LINUX:
        kill_descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)  # the worker leads its own group (see _worker_main)
    except OSError:
        pass
