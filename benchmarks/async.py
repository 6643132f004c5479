"""Synchronous, asynchronous and streaming rollouts on this machine, by layout, on two workloads.

    python benchmarks/async.py                            # PPO on the demo task (60 steps), docs/benchmarks.md
    python benchmarks/async.py --workload series          # GRPO on the series task (generation-bound)
    python benchmarks/async.py --decode-scaling          # vLLM's decode rate by concurrent sequences
    python benchmarks/async.py --workload series --layouts "stream k=2" --round 64 --repeats 1 --no-write
    python benchmarks/async.py --steps 20 --no-write

Every run is `python -m rlframe.main` with the workload's config and the same data, seed and step
budget; only the placement and the asynchronous mode differ:
- `ppo_tiny` (configs/ppo_tiny.yaml: the demo model, 128 prompts per step, PPO with a critic):
  colocated (2 processes, each with actor fsdp dp2, critic, reference and vLLM: the hybrid engine);
  split (actor, critic, reference, vLLM: one process each, weights pushed over the channel after
  each update); split async k (trainer.max_staleness=k, TIS correction, cap 2); split stream k=2
  (trainer.async_mode=stream, rounds of 4 tokens).
- `series` (configs/grpo_series.yaml: GRPO without KL on the series task, 32 prompts x 4 samples,
  responses of a few to ~270 tokens): colocated sync; split sync (actor and vLLM, one process each);
  batch pipeline k=1, 2; streaming k=1, 2, 4 (rounds of `STREAM_ROUND` tokens); the asynchronous
  ones with decoupled PPO (`tis`). (Staleness x correction: benchmarks/rollout_correction.py.)
Runs alternate between the layouts (all layouts, then all again) so background load hits them alike.
Reported per layout (medians over the repeats): the training wall time (sum of the step times,
validation excluded), generated tokens per second over that time (`perf/response_tokens`), the
share of the step spent waiting for its batch (`timing_s/gen`: in a synchronous step the generation
itself and the weight sync, in an asynchronous one what the overlap left), the wall time at which
held-out greedy accuracy first reached the target, and the final accuracy. The load average and
the fp32 matmul rate are printed before and after; a plot of accuracy against wall time goes to docs/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import machine_state, markdown_table, reproduce_line, write_section  # noqa: E402

SPLIT = ["resources.placement=split", "+resources.split_procs={actor: 1, critic: 1, ref: 1, rollout: 1}",
         "actor.dp=1", "critic.dp=1"]
PPO_LAYOUTS = {
    "colocated sync": [],
    "split sync": SPLIT,
    "split async k=1": SPLIT + ["trainer.max_staleness=1", "algorithm.off_policy_correction=tis"],
    "split async k=2": SPLIT + ["trainer.max_staleness=2", "algorithm.off_policy_correction=tis"],
    # streaming rollouts (docs/async.md): rounds of 4 tokens, above most of this task's responses
    "split stream k=2": SPLIT + ["trainer.max_staleness=2", "trainer.async_mode=stream", "rollout.partial_budget=4",
                                 "algorithm.off_policy_correction=tis"],
}
SPLIT_2 = ["resources.placement=split", "+resources.split_procs={actor: 1, rollout: 1}", "actor.dp=1"]
STREAM_ROUND = 128  # tokens per round of streaming generation (rollout.partial_budget; the sweep in docs/async.md)


def batch_async(k: int, correction: str = "tis") -> list[str]:
    return SPLIT_2 + [f"trainer.max_staleness={k}", f"algorithm.off_policy_correction={correction}"]


def stream(k: int, correction: str = "tis", round_tokens: int = STREAM_ROUND) -> list[str]:
    return batch_async(k, correction) + ["trainer.async_mode=stream", f"rollout.partial_budget={round_tokens}"]


def series_layouts(round_tokens: int = STREAM_ROUND) -> dict[str, list[str]]:
    return {
        "colocated sync": [],
        "split sync": SPLIT_2,
        "batch k=1": batch_async(1),
        "batch k=2": batch_async(2),
        **{f"stream k={k}": stream(k, round_tokens=round_tokens) for k in (1, 2, 4)},
    }


SERIES_LAYOUTS = series_layouts()


@dataclass(frozen=True)
class Workload:
    config: str
    layouts: dict[str, list[str]]
    section: str
    steps: int
    val_every: int
    target: float
    png: str


WORKLOADS = {
    "ppo_tiny": Workload("ppo_tiny", PPO_LAYOUTS, "## Split placement and asynchronous training (PPO, tiny task)",
                         steps=60, val_every=10, target=0.60, png="async.png"),
    "series": Workload("grpo_series", SERIES_LAYOUTS, "## Asynchronous and streaming rollouts (GRPO, series task)",
                       steps=20, val_every=5, target=0.70, png="async_series.png"),
}


def run_once(workload: Workload, name: str, overrides: list[str], *, steps: int, out: Path) -> dict:
    experiment = name.replace(" ", "_").replace("=", "")
    cmd = [sys.executable, "-m", "rlframe.main", "--config-name", workload.config, *overrides,
           f"trainer.total_steps={steps}", f"trainer.val_every={workload.val_every}",
           "trainer.save_every=0", "trainer.export_hf=false", "trainer.plot=false", "trainer.resume=off",
           "trainer.progress_bar=false", "trainer.loggers=[jsonl]", f"trainer.output_dir={out}",
           f"trainer.experiment={experiment}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / experiment / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows}


def summarize(rows: list[dict], *, target: float) -> dict:
    steps = [r for r in rows if r["step"] >= 1]
    clock, curve, reached = 0.0, [(0.0, rows[0].get("val/accuracy", float("nan")))], None
    for r in steps:
        clock += r["timing_s/step"]
        if "val/accuracy" in r:
            curve.append((clock, r["val/accuracy"]))
            if reached is None and r["val/accuracy"] >= target:
                reached = clock
    tokens = sum(r["perf/total_num_tokens"] for r in steps)
    generated = sum(r["perf/response_tokens"] for r in steps)
    # the step's wait for its batch (timing_s/gen, weight pushes included): in a synchronous step the
    # generation itself, in an asynchronous one what the overlap did not hide
    gen_share = sum(r.get("timing_s/gen", 0.0) for r in steps) / clock
    return {"train_s": clock, "tokens_per_s": tokens / clock, "gen_tokens_per_s": generated / clock,
            "gen_share": gen_share, "reached_s": reached, "final": curve[-1][1], "start": curve[0][1],
            "curve": curve, "staleness": max((r.get("async/staleness", 0.0) for r in steps), default=0.0)}


def plot(results: dict[str, list[dict]], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in results.items():
        xs, ys = zip(*runs[0]["curve"])
        ax.plot(xs, ys, marker="o", label=name)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.0%}")
    ax.set_xlabel("training wall time (s, validation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run_alternating(workload: Workload, runs: dict[str, list[str]], *, repeats: int, steps: int, target: float,
                    tmp: Path) -> dict[str, list[dict]]:
    """Each run of `runs` once, then all again (`repeats` rounds); summaries by name."""
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for rep in range(repeats):
        for name, overrides in runs.items():
            res = summarize(run_once(workload, name, overrides, steps=steps, out=tmp / str(rep))["rows"], target=target)
            results[name].append(res)
            print(f"{name} run {rep + 1}: {res['train_s']:.1f} s, {res['gen_tokens_per_s']:.0f} generated tok/s, "
                  f"gen share {res['gen_share']:.0%}, target at {res['reached_s']}, "
                  f"accuracy {res['start']:.3f} -> {res['final']:.3f}", flush=True)
    return results


def layout_table(results: dict[str, list[dict]], *, target: float, series: bool) -> str:
    def med(name, key):
        vals = [r[key] for r in results[name] if r[key] is not None]
        return statistics.median(vals) if vals else None

    def spread(name, key, fmt):
        vals = [r[key] for r in results[name]]
        return f"{fmt.format(med(name, key))} [{fmt.format(min(vals))}-{fmt.format(max(vals))}]"

    table = []
    for name, runs in results.items():
        reached = med(name, "reached_s")
        row = [name, spread(name, "train_s", "{:.1f}")]
        row += [spread(name, "gen_tokens_per_s", "{:.0f}"), f"{med(name, 'gen_share'):.0%}"] if series else \
            [f"{med(name, 'tokens_per_s'):.0f}"]
        row += ["not reached" if reached is None else f"{reached:.1f}"
                + (f" ({sum(r['reached_s'] is not None for r in runs)}/{len(runs)} runs)"
                   if any(r["reached_s"] is None for r in runs) else ""),
                " / ".join(f"{r['final']:.1%}" for r in runs), f"{max(r['staleness'] for r in runs):.0f}"]
        table.append(row)
    header = ["layout", "training wall time s (median [min-max])"]
    header += ["generated tokens/s (median [min-max])", "share of the step waiting for its batch"] if series else \
        ["tokens/s"]
    header += [f"s to {target:.0%} held-out", "final accuracy (each run)", "max staleness"]
    return markdown_table(header, table)


DECODE_SECTION = "## Decode rate by concurrent sequences (vLLM on CPU, series model)"


def decode_scaling(concurrency: list[int], tokens: int) -> str:
    """vLLM's generation rate with C sequences decoding at once (each exactly `tokens` new tokens, EOS
    ignored; one fresh engine per C, benchmarks/rollout.py's tuned setting): what a long tail costs, and
    what refilling its slots (streaming) could win on this machine."""
    from rollout import BASE, TUNED, run_config

    from rlframe.data.pretrain import build_pretrained_model

    model = str(build_pretrained_model(preset="demo", task="series", seed=0))
    rows, base = [], None
    for c in concurrency:
        r = run_config("vllm", model, {**BASE, **TUNED}, {"prompts": c, "n": 1, "tokens": tokens})
        base = base or r["tok_s"] / c
        rows.append([c, f"{r['tok_s']:.0f}", f"{r['gen_s'] / tokens * 1e3:.1f}", f"{r['tok_s'] / c / base:.2f}"])
        print(rows[-1], flush=True)
    return markdown_table(["concurrent sequences", "tokens/s", "ms per decode step",
                           f"tokens/s per sequence, relative to {concurrency[0]}"], rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=list(WORKLOADS), default="ppo_tiny")
    ap.add_argument("--steps", type=int, help="steps per run (default: the workload's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--target", type=float, help="held-out accuracy to time (default: the workload's)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--decode-scaling", action="store_true", help="only vLLM's decode rate by concurrent sequences")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256])
    ap.add_argument("--round", type=int, default=STREAM_ROUND,
                    help="series: tokens per streaming round (the table is written only with the default)")
    ap.add_argument("--layouts", nargs="+", help="a subset of the workload's layouts (the table in "
                                                 "docs/benchmarks.md is written only with all of them)")
    args = ap.parse_args()
    if args.decode_scaling:
        before = machine_state()
        text = decode_scaling(args.concurrency, tokens=64)
        after = machine_state()
        print(text)
        if not args.no_write:
            command = f"python benchmarks/async.py --decode-scaling --concurrency {' '.join(map(str, args.concurrency))}"
            write_section(DECODE_SECTION, f"{reproduce_line(command, before, after)}\n\n{text}")
        return
    workload = WORKLOADS[args.workload]
    if args.workload == "series" and args.round != STREAM_ROUND:
        workload = replace(workload, layouts=series_layouts(args.round))
    steps = args.steps or workload.steps
    target = workload.target if args.target is None else args.target
    unknown = set(args.layouts or ()) - set(workload.layouts)
    if unknown:
        ap.error(f"--layouts {sorted(unknown)}: {args.workload} has {list(workload.layouts)}")
    runs = {name: workload.layouts[name] for name in args.layouts or workload.layouts}
    before = machine_state()
    print(f"before: load {before['load1']:.2f}, matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_alternating(workload, runs, repeats=args.repeats, steps=steps, target=target, tmp=Path(tmp))
    after = machine_state()
    print(f"after: load {after['load1']:.2f}, matmul {after['gflops']:.0f} GFLOP/s", flush=True)
    text = layout_table(results, target=target, series=args.workload == "series")
    print(text)
    if args.no_write or len(runs) < len(workload.layouts) or args.round != STREAM_ROUND:
        return
    png = ROOT / "docs" / workload.png
    plot(results, png, target)
    command = f"python benchmarks/async.py --workload {args.workload} --steps {steps} --repeats {args.repeats}"
    body = (f"{reproduce_line(command, before, after)}\n\nconfigs/{workload.config}.yaml, {args.repeats} runs per "
            f"layout, alternating.\n\n{text}\n\n![accuracy vs wall time]({png.name})")
    write_section(workload.section, body)


if __name__ == "__main__":
    main()
