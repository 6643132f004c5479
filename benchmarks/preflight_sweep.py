"""`rlframe preflight` over the pairwise-covering sweep of the configuration space.

    python benchmarks/preflight_sweep.py [--rows N] [--steps 2]

Every row of `rlframe.controller.preflight.sweep.pairwise_rows()` (each pair of settings of
algorithm, temperature, epochs x mini-batches, dp/tp/sp, generation replicas, colocated/split,
fsdp/megatron, LoRA with dropout, partial rollouts, agent loop, async, precision, recompute, full/delta
weight syncs, direct/chained fan-out, the off-policy correction of off-policy rows appears in some
row) runs preflight for `--steps` steps on real worker groups, one Ray for all. The table lists per
row the checks run and failed, the worst rollout-vs-training log-prob gap (mean and max per token)
and the wall time; it is printed and written to docs/benchmarks.md ("## Preflight sweep").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from report import machine_line, machine_state, markdown_table, write_section  # noqa: E402

SECTION = "## Preflight sweep"


def run_row(row, *, steps: int):
    from rlframe.config import load_config, validate
    from rlframe.controller.preflight.run import run_preflight
    from rlframe.controller.preflight.sweep import config_for

    name, overrides = config_for(row)
    t0 = time.perf_counter()
    report = run_preflight(validate(load_config(name, overrides)), steps=steps, config_name=name)
    return report, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=None, help="only the first N rows of the sweep")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    from rlframe.controller.preflight.sweep import FACTORS, describe, pairwise_rows

    before = machine_state(bf16=True)
    rows = pairwise_rows()[:args.rows]
    table, failures = [], []
    for i, row in enumerate(rows):
        try:
            report, seconds = run_row(row, steps=args.steps)
        except Exception as err:  # a row that cannot run is a finding too: listed, and the sweep goes on
            table.append([i, describe(row), "-", "error", "-", "-", "-"])
            failures.append(f"- row {i}: did not run: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
            print(table[-1], failures[-1], flush=True)
            continue
        failed = report.failed
        table.append([i, describe(row), len(report.results), len(failed) or "**0**",
                      f"{report.worst('rollout vs training engine log-prob gap (mean)'):.2g}",
                      f"{report.worst('rollout vs training engine log-prob gap (max)'):.2g}", f"{seconds:.0f}"])
        failures += [f"- row {i}: {c.line()}" for c in failed]
        print(table[-1], flush=True)
        if failed:
            print(report.text(), flush=True)
    after = machine_state()
    text = "\n\n".join([
        "`python benchmarks/preflight_sweep.py` (rows of `pairwise_rows()`, 2 steps each, one Ray for all): every "
        f"pair of settings of the sweep's {len(FACTORS)} factors appears in some row; a row lists the settings that "
        "differ from the defaults (grpo, temperature 1, one epoch of one mini-batch, trained roles at dp2, 2 "
        "generation replicas, colocated, fsdp, no LoRA, no partial rollouts, no agent loop, synchronous, fp32, no "
        "recompute, full weight syncs, direct fan-out, no off-policy correction; correction=kl: mis with "
        "rejection_kl=0.05).",
        machine_line(note=f"load average {before['load1']:.1f} before, {after['load1']:.1f} after; fp32 matmul "
                          f"{before['gflops']:.0f} GFLOP/s, bf16 {before['gflops_bf16']:.0f}"),
        markdown_table(["row", "settings", "checks", "failed", "worst gap mean", "worst gap max", "seconds"], table),
        "Failed checks:\n" + "\n".join(failures) if failures else "No check failed.",
    ])
    print(text)
    if args.rows is None:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
