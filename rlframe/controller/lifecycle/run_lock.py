"""One run directory, one live run: an exclusive lock file that works on storage shared by hosts.

    with RunLock(run_dir):          # RunLocked (a ConfigError: exit code 2) when another process holds it
        ...                         # a background thread refreshes the heartbeat every heartbeat_s

`<run_dir>/run.lock` is created with O_CREAT | O_EXCL (atomic on local filesystems and NFSv3+) and
holds JSON: host, pid, the process's start time (from /proc, against pid reuse), the boot id, when the
run started, the last heartbeat and a random token. A lock is stale, and is taken over with a
message, when
  - its host is this host and its process is gone (or the pid now belongs to another process, or the
    host rebooted since): known at once, whatever the heartbeat says;
  - its host is another host and its heartbeat is older than `stale_after_s` (that host's process
    cannot be asked; its clock and ours must agree to within a fraction of that).
A live holder refuses the new launch at once, saying who holds the run and since when.

Taking over renames the stale file aside (only one of several racing launches can), checks that the
file it moved is the stale one it judged, then creates the lock afresh. A holder whose heartbeat finds
the lock no longer its own (taken over after it stalled longer than stale_after_s) says so and
`check_held(run_dir)` raises from then on, so it saves no checkpoint into a directory another process
now owns. `RLFRAME_RUN_LOCK_STALE_S` (default 120) sets stale_after_s; the heartbeat runs at a
quarter of it, at most every 30 s.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from rlframe.config.validate import ConfigError

LOCK_FILE = "run.lock"
_held: dict[str, "RunLock"] = {}  # run directory (resolved) -> the lock this process holds on it


class RunLocked(ConfigError):
    """Another live process holds the run directory."""

    def __init__(self, message: str):
        super().__init__([message])


class RunLockLost(RuntimeError):
    """This process's lock on its run directory was taken over by another launch."""


def _stale_after_default() -> float:
    return float(os.environ.get("RLFRAME_RUN_LOCK_STALE_S", "120"))


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def read_lock(path: Path) -> dict | None:
    """The lock file's record; None if it is absent; {} if it cannot be parsed (being written, or damaged)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        info = json.loads(text)
        return info if isinstance(info, dict) else {}
    except ValueError:
        return {}


class RunLock:
    def __init__(self, run_dir: str | Path, *, stale_after_s: float | None = None, heartbeat_s: float | None = None,
                 announce=None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.stale_after_s = _stale_after_default() if stale_after_s is None else float(stale_after_s)
        self.heartbeat_s = min(30.0, self.stale_after_s / 4) if heartbeat_s is None else float(heartbeat_s)
        self.token = uuid.uuid4().hex
        self.started = time.time()
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._announce = announce

    # ---- the record ----------------------------------------------------------------------------
    def _record(self) -> dict:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "pid_start": _process_start(pid), "boot_id": _boot_id(),
                "started": self.started, "started_at": _when(self.started), "heartbeat": time.time(),
                "token": self.token, "run_dir": str(self.run_dir)}

    def _say(self, message: str) -> None:
        if self._announce is not None:
            self._announce(message)
            return
        from rlframe.utils.console import say

        say(message)

    def stale_reason(self, info: dict) -> str | None:
        """Why the holder described by `info` is gone (None: it may be alive)."""
        now = time.time()
        beat = float(info.get("heartbeat", 0) or 0)
        if info.get("host") == socket.gethostname():
            boot = _boot_id()
            if info.get("boot_id") and boot and info["boot_id"] != boot:
                return "its host has rebooted since"
            pid = int(info.get("pid", -1))
            if pid <= 0 or not _alive(pid):
                return f"process {pid} on this host is gone"
            start = info.get("pid_start")
            if start is not None and _process_start(pid) not in (None, start):
                return f"process {pid} on this host is gone (the pid now belongs to another process)"
            return None
        if now - beat > self.stale_after_s:
            return (f"its heartbeat is {_ago(now - beat)} old, more than the {self.stale_after_s:.0f} s after which "
                    "a lock of another host counts as abandoned")
        return None

    def _refusal(self, info: dict) -> RunLocked:
        now = time.time()
        if not info:
            return RunLocked(
                f"run directory {self.run_dir} is locked by another launch ({self.path} is being written or is "
                f"damaged). If no run uses this directory, delete {self.path} and launch again")
        same_host = info.get("host") == socket.gethostname()
        beat = float(info.get("heartbeat", 0) or 0)
        return RunLocked(
            f"run directory {self.run_dir} is in use by another run: host {info.get('host')!r} pid {info.get('pid')}, "
            f"running since {info.get('started_at') or _when(float(info.get('started', 0)))} "
            f"({_ago(now - float(info.get('started', now)))} ago), last heartbeat {_ago(now - beat)} ago. One run "
            "directory holds one live run: wait for that run to end or stop it, or give this run its own "
            "trainer.experiment. "
            + ("Its process is alive on this host." if same_host else
               f"If that host is gone, the lock is taken over once its heartbeat is {self.stale_after_s:.0f} s old "
               f"(RLFRAME_RUN_LOCK_STALE_S), or at once if you delete {self.path}."))

    # ---- acquire / release ---------------------------------------------------------------------
    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self._record(), f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _take_over(self, info: dict, reason: str) -> None:
        """Move the stale lock aside, if it is still the one judged stale; then the caller creates it."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another launch moved it first: the caller tries to create it
        moved = read_lock(aside)
        if (moved or {}).get("token") != info.get("token"):  # a racing launch's fresh lock: put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            os.unlink(aside)
            return
        os.unlink(aside)
        self._say(f"run lock: taking over {self.path} from host {info.get('host')!r} pid {info.get('pid')} "
                  f"(running since {info.get('started_at', '?')}): {reason}")

    def acquire(self) -> "RunLock":
        """Hold the run directory, or raise RunLocked naming its holder."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        key = str(self.run_dir.resolve())
        if key in _held:
            raise RunLocked(f"run directory {self.run_dir} is already held by this process (a run in progress)")
        for attempt in range(20):
            if self._create():
                break
            info = read_lock(self.path)
            if info is None:
                continue  # released meanwhile
            if not info:  # being written this instant, or damaged
                age = time.time() - self.path.stat().st_mtime if self.path.exists() else 0.0
                if age > self.stale_after_s:
                    self._take_over({"token": None, "host": "?", "pid": "?"},
                                    f"the lock file is unreadable and {_ago(age)} old")
                    continue
                if attempt < 10:
                    time.sleep(0.1)
                    continue
                raise self._refusal(info)
            reason = self.stale_reason(info)
            if reason is None:
                raise self._refusal(info)
            self._take_over(info, reason)
        else:
            raise RunLocked(f"could not lock run directory {self.run_dir}: other launches keep taking {self.path}")
        _held[key] = self
        self._thread = threading.Thread(target=self._beat, name="rlframe-run-lock", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            info = read_lock(self.path)
            if (info or {}).get("token") != self.token:
                holder = f"host {info.get('host')!r} pid {info.get('pid')}" if info else "nobody (the file is gone)"
                self.lost = f"the lock {self.path} is now held by {holder}"
                self._say(f"run lock LOST: {self.lost}; this run writes no more checkpoints there")
                return
            tmp = self.path.with_name(f".{LOCK_FILE}.{self.token}.tmp")
            try:
                tmp.write_text(json.dumps(self._record()))
                os.replace(tmp, self.path)
            except OSError as err:  # a full disk or a hiccup of shared storage: try again next beat
                self._say(f"run lock: could not refresh the heartbeat of {self.path}: {err}")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        _held.pop(str(self.run_dir.resolve()), None)
        if self.lost is None and (read_lock(self.path) or {}).get("token") == self.token:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def live_holder(run_dir: str | Path) -> RunLocked | None:
    """The refusal a launch in `run_dir` meets now, without taking the lock: RunLocked naming the live
    process that holds it; None when nobody does, or its holder is gone (a launch takes the lock over).
    Asked before a launch validates and plans its config, whose checks (trainer.prometheus_port free,
    the checkpoint to resume) would otherwise answer for the holder: the port is the live run's."""
    lock = RunLock(run_dir)
    if str(lock.run_dir.resolve()) in _held:
        return RunLocked(f"run directory {lock.run_dir} is already held by this process (a run in progress)")
    info = read_lock(lock.path)
    if not info or lock.stale_reason(info) is not None:  # absent, being written (acquire waits), or stale
        return None
    return lock._refusal(info)


def check_held(run_dir: str | Path) -> None:
    """Raise RunLockLost if this process locked `run_dir` and another launch has since taken it over."""
    lock = _held.get(str(Path(run_dir).resolve()))
    if lock is not None and lock.lost:
        raise RunLockLost(f"run directory {lock.run_dir}: {lock.lost} (this process stalled for longer than "
                          f"{lock.stale_after_s:.0f} s, so its lock counted as abandoned); stopping before writing")
