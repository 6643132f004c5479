"""What trainer.trace=true costs: the demo job with the trace off and on, alternately.

    python benchmarks/trace_overhead.py                 # 3 pairs of 6 steps, writes docs/benchmarks.md
    python benchmarks/trace_overhead.py --pairs 2 --steps 4 --no-write

Every run is `python -m rlframe.main` (configs/ppo_tiny.yaml: the demo model, PPO with a critic, the
hybrid engine on CPU) with the same data, seed and step budget, no validation and no checkpoint in
between; the runs alternate (off, on, off, on, ...) so background load hits both alike. Per run:
the median of perf/time_per_step over steps >= 2 (step 1 includes the engines' first compile and
warm-up). Reported: the median over the runs of each setting, the overhead of the median run with
trace on over the median with it off, and its spread (the lowest and highest overhead of one "on"
run over the median "off" run), the load average and fp32 matmul rate before and after, and the
size of the trace files written.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from rlframe.jobs import read_metrics  # noqa: E402
from report import machine_line, machine_state, markdown_table, write_section  # noqa: E402

SECTION = "## Trace overhead (trainer.trace)"
JOB = ["trainer.val_every=0", "trainer.save_every=0", "trainer.save_every_minutes=0", "trainer.export_hf=false",
       "trainer.plot=false", "trainer.resume=off", "trainer.progress_bar=false", "trainer.loggers=[jsonl]"]


def run_once(*, trace: bool, steps: int, out: Path, index: int) -> dict:
    name = f"trace_{'on' if trace else 'off'}_{index}"
    cmd = [sys.executable, "-m", "rlframe.main", *JOB, f"trainer.total_steps={steps}", f"trainer.output_dir={out}",
           f"trainer.experiment={name}", f"trainer.trace={'true' if trace else 'false'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_dir = out / name
    rows = read_metrics(run_dir)
    times = [r["perf/time_per_step"] for r in rows if r.get("step", 0) >= 2 and "perf/time_per_step" in r]
    if not times:
        raise RuntimeError(f"{name}: no perf/time_per_step for steps >= 2 in {run_dir / 'metrics.jsonl'}")
    trace_file = run_dir / "trace.json"
    return {"step_s": statistics.median(times), "trace_bytes": trace_file.stat().st_size if trace_file.exists() else 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    args = p.parse_args()
    before = machine_state()
    print(f"before: load {before['load1']:.2f}, fp32 matmul {before['gflops']:.1f} GFLOP/s", flush=True)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="rlframe-trace-bench-") as tmp:
        for i in range(args.pairs):
            for trace in (False, True):
                r = run_once(trace=trace, steps=args.steps, out=Path(tmp), index=i)
                runs[trace].append(r)
                print(f"pair {i + 1}: trace {'on ' if trace else 'off'} median step {r['step_s']:.3f} s"
                      + (f", trace.json {r['trace_bytes'] / 1024:.0f} KiB" if trace else ""), flush=True)
    after = machine_state()
    print(f"after: load {after['load1']:.2f}, fp32 matmul {after['gflops']:.1f} GFLOP/s", flush=True)

    off = statistics.median(r["step_s"] for r in runs[False])
    on = statistics.median(r["step_s"] for r in runs[True])
    each = [100 * (r["step_s"] / off - 1) for r in runs[True]]
    overhead = 100 * (on / off - 1)
    rows = [["off", f"{off:.3f}", ", ".join(f"{r['step_s']:.3f}" for r in runs[False]), "", ""],
            ["on", f"{on:.3f}", ", ".join(f"{r['step_s']:.3f}" for r in runs[True]),
             f"{overhead:+.1f}% ({min(each):+.1f}% .. {max(each):+.1f}%)",
             f"{statistics.median(r['trace_bytes'] for r in runs[True]) / 1024:.0f} KiB"]]
    table = markdown_table(["trainer.trace", "median step (s)", "each run's median step (s)",
                            "overhead (spread over runs)", "trace.json"], rows)
    print(table)
    command = "python benchmarks/trace_overhead.py" + (
        f" --pairs {args.pairs}" if args.pairs != 3 else "") + (f" --steps {args.steps}" if args.steps != 6 else "")
    body = "\n\n".join([
        f"`{command}`: `python -m rlframe.main` (configs/ppo_tiny.yaml, {args.steps} steps, "
        f"{shlex.join(JOB)}) run {args.pairs} times with trainer.trace=false and {args.pairs} times with true, "
        "alternately. Per run the median perf/time_per_step over steps >= 2; per setting the median over its runs; "
        "the spread is each traced run's median against the untraced median.",
        table,
        f"Load average {before['load1']:.2f} before, {after['load1']:.2f} after; fp32 matmul "
        f"{before['gflops']:.1f} GFLOP/s before, {after['gflops']:.1f} after (2 threads).",
        machine_line(),
    ])
    if not args.no_write:
        write_section(SECTION, body)
        print(f"wrote the section {SECTION!r} of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
