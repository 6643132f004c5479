"""Reward scoring inline vs in a process pool, for a cheap rule reward and for math-verify.

Prints a markdown table and replaces the "## Reward manager" section of docs/benchmarks.md.
The pool is started (and warmed with one batch) before timing: its start-up cost is paid once per
run, not per step. Reproduce: `python benchmarks/reward_manager.py` (`--no-write` only prints the table).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import report  # noqa: E402

from rlframe.rewards.manager import RewardManager  # noqa: E402


def workloads(batch: int):
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 100, batch), rng.integers(0, 100, batch)
    arith = ([str(x + y + (i % 2)) for i, (x, y) in enumerate(zip(a, b))], ["arithmetic"] * batch,
             [str(x + y) for x, y in zip(a, b)])
    math = ([f"so the answer is $\\boxed{{\\frac{{{x}}}{{{y + 1}}}}}$" for x, y in zip(a, b)], ["math"] * batch,
            [f"\\frac{{{2 * x}}}{{{2 * (y + 1)}}}" for x, y in zip(a, b)])
    return {"arithmetic (exact match)": arith, "math (math-verify)": math}


READING = """Reading the table: a rule reward costs about 2 us per sample inline, far less than sending the
strings to a worker and back, so a pool only adds latency (and 1 to 3 s of start-up per run). math-verify
costs about 20 ms per sample, but on 2 cores that are already busy with training and generation the pool
has no idle core to use either. Hence `DEFAULT_NUM_WORKERS = 0` (inline); set `reward.num_workers` to the
number of otherwise idle cores for expensive rewards (math-verify, code execution) on bigger machines."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-write", action="store_true", help="print the table, leave docs/benchmarks.md alone")
    args = p.parse_args()
    rows = []
    for batch, names in ((128, None), (1024, ["arithmetic (exact match)"])):
        for name, (resp, src, gt) in workloads(batch).items():
            if names is not None and name not in names:
                continue
            for workers in (0, 1, 2):
                with RewardManager(num_workers=workers) as mgr:
                    t0 = time.perf_counter()
                    mgr.compute(resp[:4], data_sources=src[:4], ground_truths=gt[:4])  # start + warm the pool
                    start = time.perf_counter() - t0
                    sec = report.median_seconds(lambda: mgr.compute(resp, data_sources=src, ground_truths=gt), 3)
                rows.append([name, batch, workers, f"{sec * 1e3:.1f}", f"{sec / batch * 1e6:.0f}", f"{start:.2f}"])
                print(rows[-1], flush=True)
    table = report.markdown_table(
        ["reward", "batch", "num_workers (0 = inline)", "median ms / batch", "us / sample", "pool start s"], rows)
    body = (
        "Reproduce: `python benchmarks/reward_manager.py`\n"
        f"{report.machine_line()} Median of 3 batches after a warm-up batch; the machine was shared with "
        "other jobs, so absolute numbers vary between runs.\n\n" + table + "\n\n" + READING
    )
    print(table)
    if not args.no_write:
        report.write_section("## Reward manager", body)


if __name__ == "__main__":
    main()
