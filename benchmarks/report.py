"""Shared by the benchmark scripts: timing and writing a section of docs/benchmarks.md.

Each script owns one `## ...` section of docs/benchmarks.md and replaces only that section, so
scripts can be rerun in any order. Scripts run as `python benchmarks/NAME.py` and import this
module as `report`.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def median_seconds(fn, repeats: int, *, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_line() -> str:
    import torch

    return (f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
            f"torch {torch.__version__}; measured {time.strftime('%Y-%m-%d', time.gmtime())}.")


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(section: str, body: str, *, path: Path = BENCHMARKS_MD) -> None:
    """Replace (or append) the `section` heading and its body in docs/benchmarks.md."""
    text = f"{section}\n\n{body.strip()}\n"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find(section + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(section))
        new = old[:start] + text + ("" if end < 0 else old[end:])
    path.write_text(new if new.endswith("\n") else new + "\n")
