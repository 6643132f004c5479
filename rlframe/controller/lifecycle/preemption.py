"""SIGTERM and SIGINT in the driver: a scheduler's preemption (SLURM, Kubernetes, spot instances send
SIGTERM and wait a grace period) or Ctrl-C.

The first signal asks the run to stop: the step in flight finishes, a verified checkpoint is written
when it fits in what is left of `trainer.preempt_grace_s` (judged by the last checkpoint's write
time), the worker groups and Ray stop, one line says where to resume, and the process exits with
EXIT_CODES (143 for SIGTERM, 130 for SIGINT: 128 + the signal, what schedulers expect). A second
signal stops at once (the newest checkpoint stands). The resumed run continues exactly as an
uninterrupted one: the checkpoint is taken at a step boundary like any other.
"""

from __future__ import annotations

import signal
import threading
import time

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


class Preempted(Exception):
    """The run stopped on a signal; `line` says what was kept and how to resume; `code` is the exit code."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.line, self.code = line, code


class PreemptionWatch:
    """Signal handlers for the run's duration (`with PreemptionWatch(grace_s=...) as watch:`)."""

    def __init__(self, *, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.at = 0.0
        self._old: dict = {}

    def __enter__(self) -> "PreemptionWatch":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._old = {sig: signal.signal(sig, self._on_signal) for sig in EXIT_CODES}
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _on_signal(self, signum, frame) -> None:
        from rlframe.utils.console import say

        if self.signum is not None:  # the second signal: stop now
            raise SystemExit(EXIT_CODES[signum])
        self.signum, self.at = signum, time.monotonic()
        say(f"received {signal.Signals(signum).name}: finishing the step in flight, then a checkpoint if it fits in "
            f"trainer.preempt_grace_s={self.grace_s:g} s; send it again to stop at once")

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def code(self) -> int:
        return EXIT_CODES.get(self.signum, 1)

    def time_left(self) -> float:
        return self.grace_s - (time.monotonic() - self.at)
