"""The tool worker's side of the sandbox (sandbox.py states the contract and holds the caller,
`ToolRunner`): the plain-data format both sides speak on their pipes, and the worker process that
loads the tools and runs every call in a forked process of its own under hard limits.

    worker_main(conn, specs, max_chars)         # the worker process's body (ToolRunner starts it)
    encode(obj), decode_reply(data, statuses)   # JSON bytes on the pipes, never pickle
    truncate(text, max_chars)                   # a result cut to max_result_chars
"""

from __future__ import annotations

import json
import math
import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from rlframe.agents.process_limits import (descendants, drop_resource_capability, kill_descendants, prctl,
                                           reap_children, set_limits)
from rlframe.agents.tools import BUILTIN_SOURCE, BUILTIN_TOOLS, Tool, load_tools

WORKER_STATUSES = ("ok", "error", "timeout")  # the statuses a worker's reply may carry
TRUNCATION_MARKER = " ...[truncated]"
_CALL_STATUSES = ("ok", "error")  # what a call's process may report
LINUX = sys.platform.startswith("linux") and os.path.isdir("/proc/self")
_PR_SET_CHILD_SUBREAPER = 36


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


def decode_json(data: bytes) -> Any:
    """The object of ASCII JSON bytes read from a pipe; ValueError saying how they start otherwise."""
    try:
        return json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__}; starts with {bytes(data[:16])!r})") from None


def decode_reply(data: bytes, statuses: Sequence[str]) -> tuple[str, str]:
    """(status, text) from a reply that must be the JSON array [status, text], status one of
    `statuses` and text a string; ValueError saying what is wrong with anything else."""
    obj = decode_json(data)
    if not (isinstance(obj, list) and len(obj) == 2 and obj[0] in statuses and isinstance(obj[1], str)):
        raise ValueError(f"not a [status, text] pair with a status in {list(statuses)} (got {str(obj)[:80]})")
    return obj[0], obj[1]


def max_reply_bytes(max_chars: int) -> int:
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
    if not LINUX:
        try:
            os.killpg(pid, signal.SIGKILL)  # its session's first group: what it started there
        except OSError:
            pass
    if reap_children() and LINUX:
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
        data, status = _wait_call(pid, r, msg["timeout_s"], max_reply_bytes(max_chars))
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


def worker_main(conn, specs, max_chars: int) -> None:
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
    keep = frozenset(descendants(os.getpid())) if LINUX else frozenset()  # started by the tools files
    conn.send_bytes(encode(["ready", None]))
    try:
        _serve(conn, fns, max_chars, keep)
    finally:
        if LINUX:
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
