"""Shared by the benchmark scripts: timing, markdown tables and writing a section of docs/benchmarks.md.

Each script owns one `## ...` section of docs/benchmarks.md and replaces only that section, so
scripts can be rerun in any order. Scripts run as `python benchmarks/NAME.py` and import this
module as `report`.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from rlframe.utils.machine import cpu_model

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


def machine_line(*, note: str = "", packages: dict[str, str] | None = None) -> str:
    """One sentence naming the CPU, torch (and `packages`: name -> version) and today's date (UTC).

    `note` (e.g. "shared with other jobs") follows the CPU, separated by a semicolon.
    """
    import torch

    cpu = f"{os.cpu_count()} CPU cores ({cpu_model()})"
    versions = [f"torch {torch.__version__}"] + [f"{k} {v}" for k, v in (packages or {}).items()]
    return (f"Machine: {cpu}{f', {note};' if note else ','} {', '.join(versions)}; "
            f"measured {time.strftime('%Y-%m-%d', time.gmtime())}.")


def reproduce_line(command: str, before: dict, after: dict) -> str:
    """The first line of a section: its command, the machine, the load average and fp32 matmul rate
    (`machine_state()`) before and after the measurement."""
    return (f"Reproduce: `{command}`. {machine_line()} Load average {before['load1']:.1f} before, "
            f"{after['load1']:.1f} after; fp32 matmul {before['gflops']:.0f} / {after['gflops']:.0f} GFLOP/s.")


def markdown_row(cells) -> str:
    """`| a | b |`: one table row (scripts that print rows as they are measured use it directly)."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = [markdown_row(header), "|" + "---|" * len(header)]
    lines += [markdown_row(row) for row in rows]
    return "\n".join(lines)


def _section_span(text: str, section: str) -> tuple[int, int] | None:
    """(start, end) of `section`'s heading and body in `text`; end is at the next `\\n## ` or the end."""
    start = text.find(section + "\n")
    if start < 0:
        return None
    end = text.find("\n## ", start + len(section))
    return start, (len(text) if end < 0 else end)


def read_section(section: str, *, path: Path = BENCHMARKS_MD) -> str | None:
    """The current body of `section` (without its heading), or None where it is not there yet."""
    text = path.read_text() if path.exists() else ""
    span = _section_span(text, section)
    return None if span is None else text[span[0] + len(section):span[1]].strip("\n")


def write_section(section: str, body: str, *, path: Path = BENCHMARKS_MD) -> None:
    """Replace (or append) the `section` heading and its body in docs/benchmarks.md.

    Re-reads the file just before writing: other scripts own the other sections.
    """
    text = f"{section}\n\n{body.strip()}\n"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    span = _section_span(old, section)
    if span is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        new = old[:span[0]] + text + old[span[1]:]
    path.write_text(new if new.endswith("\n") else new + "\n")


def matmul_gflops(*, seconds: float = 1.5, threads: int = 2, n: int = 1024, dtype: str = "float32") -> float:
    """The machine's matmul rate now (fp32 unless `dtype`): best GFLOP/s of (n x n) @ (n x n) with
    `threads` torch threads over about `seconds` (the ceiling that model FLOP rates are compared with)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
    a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    torch.set_num_threads(old)
    return best


def machine_state(*, bf16: bool = False) -> dict[str, float]:
    """1-minute load average and the fp32 matmul rate (2 threads), to print with every measurement;
    with `bf16`, the bf16 rate too (`gflops_bf16`)."""
    out = {"load1": os.getloadavg()[0], "gflops": matmul_gflops()}
    if bf16:
        out["gflops_bf16"] = matmul_gflops(dtype="bfloat16")
    return out
