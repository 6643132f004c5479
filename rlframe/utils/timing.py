"""Named phase timers: `with timed(metrics, "gen"): ...` adds the seconds to metrics["timing_s/gen"]."""

from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def timed(timing: dict, name: str):
    t0 = time.perf_counter()
    yield
    timing[f"timing_s/{name}"] = timing.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0
