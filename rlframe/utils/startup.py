"""Where the time from `python -m rlframe.main` to the first training step goes.

The driver marks the end of each start-up stage with `mark(name)`; `breakdown()` turns the marks
into seconds per stage, counted from the process's own start (so interpreter start-up and imports
are included). The trainer prints `summary()` before its first step and logs the stages as
`timing_s/startup/<stage>` with step 1's metrics.

    mark("ray")            # after Ray started
    mark("worker processes")
    print(summary())       # "start-up 14.2 s: python, imports and config 3.1, ray 4.0, ..."

`matmul_rates()` measures this CPU's fp32 and bf16 matmul rates (rlframe/controller/cpu_precision.py
says at start-up when a CPU run asks for bf16 and bf16 is the slower here; the planner calibrates with it).
"""

from __future__ import annotations

import os
import re
import time

_marks: list[tuple[str, float]] = []


def process_start() -> float:
    """This process's start time (seconds since the epoch).

    On Linux it is read from /proc: now minus (uptime - the process's start tick), exact to a clock
    tick. psutil's `create_time` adds the start tick to the boot time of /proc/stat, which is whole
    seconds, so it can be up to a second early (0.9 s on the machine the start-up table was taken on).
    """
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after "pid (comm)"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # no psutil: count from the first mark instead
        return _marks[0][1] if _marks else time.time()


def mark(stage: str) -> None:
    """The stage `stage` ended now (stages are named after what happened since the previous mark)."""
    _marks.append((stage, time.time()))


def reset() -> None:
    _marks.clear()


def breakdown() -> dict[str, float]:
    """Seconds per stage, in order, from the process start; a repeated stage name adds up."""
    out: dict[str, float] = {}
    prev = process_start()
    for stage, at in _marks:
        out[stage] = out.get(stage, 0.0) + max(0.0, at - prev)
        prev = at
    return out


def summary() -> str:
    stages = breakdown()
    parts = ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
    return f"start-up {sum(stages.values()):.1f} s: {parts}"


def metrics() -> dict[str, float]:
    """`timing_s/startup/<stage>` (stage names as metric-safe words) and `timing_s/startup/total`."""
    stages = breakdown()
    out = {f"timing_s/startup/{re.sub(r'[^a-z0-9]+', '_', k.lower()).strip('_')}": v for k, v in stages.items()}
    out["timing_s/startup/total"] = sum(stages.values())
    return out


# A CPU run in bf16 is faster only where the CPU's bf16 matmuls are: several times on AMX Xeons and
# Zen 5, half the speed on Xeons without AMX (docs/benchmarks.md). Measured, not read from CPU flags.
def matmul_rates(n: int = 512, repeats: int = 8) -> tuple[float, float]:
    """(fp32, bf16) GFLOP/s of an (n x n) @ (n x n) matmul on this CPU: best of `repeats` after one
    warm-up, with torch's current thread count (a few milliseconds at n=512)."""
    import torch

    def rate(dtype) -> float:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / max(best, 1e-9) / 1e9

    return rate(torch.float32), rate(torch.bfloat16)
