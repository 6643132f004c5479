"""Named phase timers: `with timed(metrics, "gen"): ...` adds the seconds to metrics["timing_s/gen"]
(and records the phase in the run's trace when trainer.trace is on: rlframe/utils/trace.py)."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rlframe.utils import trace


@contextmanager
def timed(timing: dict, name: str):
    t0 = time.perf_counter()
    with trace.span(name):
        yield
    timing[f"timing_s/{name}"] = timing.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0
