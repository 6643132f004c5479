"""rlframe's GRPO vs Hugging Face TRL's GRPOTrainer, side by side on this machine.

    python benchmarks/vs_trl.py                       # both workloads, 2 runs each, writes docs/benchmarks.md
    python benchmarks/vs_trl.py --workloads 12m --repeats 3 --layouts dp2,dp1 --no-write

Workloads (the same local model directory, task and settings for both systems):
- `12m`: the `12m` preset (11.9M parameters, random init, seed 0), two-digit sums, 64 prompts x 4
  samples, 16 new tokens, temperature 1, lr 1e-5, no KL, one optimizer step per batch, fp32, 8 steps
  (the first 2 are warm-up and not counted).
- `--precisions fp32,bf16` runs each workload in each: bf16 is TRL's `bf16=True` (the Trainer's CPU
  autocast) against rlframe's `actor.precision=bf16` (bf16 compute, fp32 master weights, vLLM in bf16);
  its compute floor uses the bf16 matmul rate measured in the same run.
- `demo`: the default demo model (0.8M parameters, pre-trained on sums), 64 x 4, 8 new tokens,
  lr 1e-4, no KL, 40 steps; greedy accuracy on the 256 held-out prompts before and after.

TRL runs in its own virtual environment (created on first use under ~/.cache/rlframe/trl-venv:
`pip install torch==2.13.0 trl==1.16.0`; TRL needs a newer transformers than rlframe pins, so it is
no dependency of rlframe), in one process with 2 torch threads, transformers `generate`, and
activation checkpointing off (TRL's default is on; off is faster for models this small). rlframe
runs `python -m rlframe.main --config-name grpo_tiny` with overrides (dp2: 2 worker processes x 1
thread, vLLM rollout). Runs alternate (TRL, rlframe, TRL, rlframe, ...) so that load from other jobs
hits both alike. Printed with every table: the fp32 matmul rate (2 threads) and the 1-minute load
average, before and after. Compute floor of a step = 8 x parameters x tokens / matmul rate
(6N per trained token, 2N per generated or prefilled token; attention FLOPs ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import machine_state, markdown_table, write_section  # noqa: E402

TRL_VENV = Path(os.environ.get("RLFRAME_TRL_VENV", "~/.cache/rlframe/trl-venv")).expanduser()
TRL_PACKAGES = ["torch==2.13.0", "trl==1.16.0"]
SECTION = "## rlframe vs TRL (GRPO step on CPU)"


@dataclass(frozen=True)
class Workload:
    name: str
    preset: str
    pretrained: bool
    new_tokens: int
    lr: float
    steps: int
    warmup: int
    evaluate: bool
    prompts: int = 64
    n: int = 4
    precision: str = "fp32"  # fp32 | bf16 (TRL: bf16=True, the Trainer's autocast; rlframe: actor.precision=bf16)


WORKLOADS = {
    "12m": Workload("12m", "12m", pretrained=False, new_tokens=16, lr=1e-5, steps=8, warmup=2, evaluate=False),
    "demo": Workload("demo", "demo", pretrained=True, new_tokens=8, lr=1e-4, steps=40, warmup=3, evaluate=True),
}


# ---- TRL's environment --------------------------------------------------------------------------
def ensure_trl_venv() -> Path:
    python = TRL_VENV / "bin" / "python"
    marker = TRL_VENV / ".installed"
    if marker.exists() and marker.read_text().strip() == " ".join(TRL_PACKAGES):
        return python
    print(f"creating TRL's virtual environment at {TRL_VENV} ({' '.join(TRL_PACKAGES)}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_PACKAGES], check=True)
    marker.write_text(" ".join(TRL_PACKAGES))
    return python


# ---- models and data ----------------------------------------------------------------------------
def prepare(w: Workload, work: Path) -> dict:
    """The model directory, rlframe's overrides for it, and the prompt files in TRL's format."""
    from rlframe.config import load_config
    from rlframe.controller.trainers.prepare import cache_root, model_path, task_files
    from rlframe.data.tiny_model import build_random_model, count_parameters

    cfg = load_config("grpo_tiny", [f"model.tiny_preset={w.preset}"])
    if w.pretrained:
        path = model_path(cfg)
    else:
        path = cache_root(cfg) / "bench" / f"{w.preset}-random-seed0"
        if not (path / "config.json").exists():
            build_random_model(path, preset=w.preset, seed=0)
    train, test = task_files(cfg)
    files = {"train": work / f"{w.name}-train.jsonl", "test": work / f"{w.name}-test.jsonl"}
    for split, src in (("train", train[0]), ("test", test[0])):
        _to_jsonl(src, files[split])
    return {"model": str(path), "params": count_parameters(w.preset), **{k: str(v) for k, v in files.items()}}


def _to_jsonl(parquet: str, out: Path) -> None:
    import pandas as pd

    df = pd.read_parquet(parquet)
    with open(out, "w") as f:
        for prompt, rm in zip(df["prompt"], df["reward_model"]):
            f.write(json.dumps({"prompt": [dict(m) for m in prompt], "answer": rm["ground_truth"]}) + "\n")


# ---- one run of each system ---------------------------------------------------------------------
def run_trl(python: Path, w: Workload, data: dict, work: Path) -> dict:
    out = work / f"trl-{w.name}-{time.monotonic_ns()}.json"
    cmd = [str(python), str(ROOT / "benchmarks" / "trl_runner.py"), "--model", data["model"], "--train",
           data["train"], "--out", str(out), "--steps", str(w.steps), "--prompts", str(w.prompts), "--n", str(w.n),
           "--new-tokens", str(w.new_tokens), "--lr", str(w.lr)]
    if w.evaluate:
        cmd += ["--test", data["test"]]
    if w.precision == "bf16":
        cmd += ["--bf16"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(work))
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    r = json.loads(out.read_text())
    steps = r["step"][w.warmup:]
    gens = r["gen"][w.warmup:]
    return {"system": "TRL", "layout": f"1 proc x 2 threads, {w.precision}", "step": steps, "tokens": r["tokens"][w.warmup:],
            "phases": {"gen": gens, "train": [s - g for s, g in zip(steps, gens)]},
            "startup": r["first_step_at"], "wall": time.time() - t0,
            "acc": (r["accuracy_before"], r["accuracy_after"])}


LAYOUTS = {  # rlframe's process/thread layouts on one node
    "dp2": ["actor.dp=2", "resources.procs_per_node=2", "resources.cpus_per_proc=1"],
    "dp1": ["actor.dp=1", "resources.procs_per_node=1", "resources.cpus_per_proc=2"],
}
RLFRAME_PHASES = ("gen", "old_log_prob", "update_actor", "update_weights")


def rlframe_overrides(w: Workload, data: dict, layout: str, run_dir: Path) -> list[str]:
    return [f"model.path={data['model']}", f"data.response_length={w.new_tokens}",
            f"data.train_batch_size={w.prompts}", f"algorithm.n_samples={w.n}", "algorithm.use_kl_loss=false",
            "ref.enabled=false", f"actor.lr={w.lr}", f"actor.mini_batch_size={w.prompts * w.n}",
            "actor.micro_batch_size=32", f"trainer.total_steps={w.steps}",
            f"trainer.val_every={w.steps if w.evaluate else 0}", "trainer.export_hf=false", "trainer.resume=off",
            "trainer.progress_bar=false", f"trainer.output_dir={run_dir}", "trainer.experiment=bench",
            *LAYOUTS[layout], *([f"actor.precision={w.precision}"] if w.precision != "fp32" else [])]


def run_rlframe(w: Workload, data: dict, work: Path, layout: str, src: Path = ROOT, label: str = "rlframe") -> dict:
    """One run of `python -m rlframe.main` from the source tree `src` (another commit's, for before/after)."""
    run_dir = work / f"rlframe-{w.name}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "rlframe.main", "--config-name", "grpo_tiny",
           *rlframe_overrides(w, data, layout, run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(src), os.environ.get("PYTHONPATH"))))}
    t0 = time.time()
    step1_end, log = None, []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(src),
                          env=env) as p:
        for line in p.stdout:
            log.append(line)
            if step1_end is None and re.search(rf"step 1/{w.steps}\b", line):
                step1_end = time.time() - t0
    if p.returncode != 0:
        raise RuntimeError(f"rlframe run failed ({p.returncode}):\n{''.join(log[-60:])}")
    rows = [json.loads(x) for x in (run_dir / "bench" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "timing_s/step" in r]
    steps = [r["timing_s/step"] for r in rows][w.warmup:]
    phases = {k: [r.get(f"timing_s/{k}", 0.0) for r in rows][w.warmup:] for k in RLFRAME_PHASES
              if any(f"timing_s/{k}" in r for r in rows)}  # old_log_prob is skipped when on-policy
    phases["other"] = [r.get("timing_s/overhead/total", float("nan")) for r in rows][w.warmup:]
    vals = [r["val/accuracy"] for r in _val_rows(run_dir)]
    first_step = rows[0]["timing_s/step"]
    return {"system": label, "layout": f"{layout}, {w.precision}", "step": steps,
            "tokens": [r["perf/total_num_tokens"] for r in rows][w.warmup:], "phases": phases,
            "startup": rows[0].get("timing_s/startup/total", (step1_end or float("nan")) - first_step),
            "first_step": first_step,
            "wall": time.time() - t0, "acc": (vals[0], vals[-1]) if len(vals) >= 2 else (None, None),
            "overhead": _overhead_breakdown(rows[w.warmup:])}


def _val_rows(run_dir: Path) -> list[dict]:
    text = (run_dir / "bench" / "metrics.jsonl").read_text()
    return [r for r in (json.loads(x) for x in text.splitlines() if x.strip()) if "val/accuracy" in r]


def _overhead_breakdown(rows: list[dict]) -> dict[str, float]:
    """Median of every `timing_s/overhead/...` key the trainer reports (issue 20's breakdown)."""
    keys = sorted({k for r in rows for k in r if k.startswith("timing_s/overhead")})
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


# ---- the table ----------------------------------------------------------------------------------
def med(xs) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def _fmt(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"  # NaN: the run did not report it (an older rlframe)


def summarize(runs: list[dict], *, params: int, gflops: float, evaluate: bool) -> tuple[list[list], float]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["system"], r["layout"]), []).append(r)
    tokens = med([t for r in runs for t in r["tokens"]])
    floor = 8 * params * tokens / (gflops * 1e9)
    rows = []
    for (system, layout), rs in groups.items():
        per_run = [med(r["step"]) for r in rs]
        step = med(per_run)
        phases = ", ".join(f"{k} {_fmt(med([med(r['phases'][k]) for r in rs]))}" for k in rs[0]["phases"])
        row = [system, layout, f"{step:.2f} ({', '.join(f'{s:.2f}' for s in per_run)})",
               f"{med([t for r in rs for t in r['tokens']]) / step:,.0f}", phases, f"{floor / step:.0%}",
               f"{med([r['startup'] for r in rs]):.1f}"]
        if evaluate:
            accs = [r["acc"] for r in rs if r["acc"][0] is not None]
            row.append("; ".join(f"{a:.1%} -> {b:.1%}" for a, b in accs) or "-")
        rows.append(row)
    return rows, floor


def run_workload(w: Workload, *, repeats: int, layouts: list[str], trl_python: Path, work: Path,
                 baseline: tuple[str, Path] | None = None) -> str:
    data = prepare(w, work)
    bf16 = w.precision == "bf16"
    before = machine_state(bf16=bf16)
    print(f"[{w.name} {w.precision}] load {before['load1']:.1f}, matmul {before['gflops']:.0f} GFLOP/s"
          + (f" (bf16 {before['gflops_bf16']:.0f})" if bf16 else ""), flush=True)
    runs = []
    for rep in range(repeats):
        # the baseline commit runs the fp32 tables only (a commit before `precision` has no bf16)
        for system in ["trl", *layouts, *(["baseline"] if baseline and w.precision == "fp32" else [])]:
            if system == "trl":
                r = run_trl(trl_python, w, data, work)
            elif system == "baseline":
                r = run_rlframe(w, data, work, layouts[0], src=baseline[1], label=f"rlframe @ {baseline[0]}")
            else:
                r = run_rlframe(w, data, work, system)
            runs.append(r)
            print(f"[{w.name}] run {rep + 1}/{repeats} {r['system']} {r['layout']}: median s/step "
                  f"{med(r['step']):.3f}, start-up {r['startup']:.1f} s, load {os.getloadavg()[0]:.1f}"
                  + (f", overhead {r['overhead']}" if r.get("overhead") else ""), flush=True)
    after = machine_state(bf16=bf16)
    rate = "gflops_bf16" if bf16 else "gflops"  # the floor at the rate of the precision the step runs in
    gflops = max(before[rate], after[rate])
    rows, floor = summarize(runs, params=data["params"], gflops=gflops, evaluate=w.evaluate)
    header = ["system", "layout", "s/step median (per run)", "tokens/s", "phases s (median)", "floor / step",
              "start-up s"] + (["held-out greedy acc before -> after"] if w.evaluate else [])
    note = (f"**{w.name}, {w.precision}**: {w.prompts} prompts x {w.n} samples, {w.new_tokens} new tokens, lr {w.lr:g}, "
            f"{w.steps} steps ({w.warmup} warm-up steps not counted), {repeats} alternating runs per system. "
            f"Load average (1 min) {before['load1']:.1f} before, {after['load1']:.1f} after; fp32 matmul "
            f"{before['gflops']:.0f} / {after['gflops']:.0f} GFLOP/s before / after (2 threads)"
            + (f", bf16 {before['gflops_bf16']:.0f} / {after['gflops_bf16']:.0f}" if bf16 else "") + ". "
            f"Compute floor of a step: {floor:.2f} s ({data['params'] / 1e6:.2f}M parameters x 8 x "
            f"{med([t for r in runs for t in r['tokens']]):,.0f} tokens at {gflops:.0f} {w.precision} GFLOP/s).")
    return note + "\n\n" + markdown_table(header, rows)


def checkout(commit: str, dest: Path) -> Path:
    """The repository's files as of `commit`, extracted to `dest` (the working tree is not touched)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="12m,demo", help=f"comma-separated, of {sorted(WORKLOADS)}")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layouts", default="dp2", help=f"rlframe layouts, comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--baseline", default=None, metavar="COMMIT",
                    help="also run rlframe as of COMMIT (git archive into a temp dir), e.g. for before/after")
    ap.add_argument("--steps", type=int, default=None, help="override every workload's steps (quick checks)")
    ap.add_argument("--precisions", default="fp32", help="comma-separated, of fp32,bf16: each workload at each")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    names, layouts = args.workloads.split(","), args.layouts.split(",")
    precisions = args.precisions.split(",")
    unknown = ([n for n in names if n not in WORKLOADS] + [x for x in layouts if x not in LAYOUTS]
               + [p for p in precisions if p not in ("fp32", "bf16")])
    if unknown:
        raise SystemExit(f"unknown workload/layout/precision {unknown}; workloads {sorted(WORKLOADS)}, "
                         f"layouts {sorted(LAYOUTS)}, precisions fp32, bf16")
    trl_python = ensure_trl_venv()
    if args.steps is not None:
        WORKLOADS.update({n: replace(w, steps=args.steps, warmup=min(w.warmup, args.steps - 1))
                          for n, w in WORKLOADS.items()})
    with tempfile.TemporaryDirectory(prefix="rlframe-vs-trl-") as tmp:
        baseline = (args.baseline, checkout(args.baseline, Path(tmp) / "baseline")) if args.baseline else None
        bodies = [run_workload(replace(WORKLOADS[n], precision=p), repeats=args.repeats, layouts=layouts,
                               trl_python=trl_python, work=Path(tmp), baseline=baseline)
                  for n in names for p in precisions]
    command = (f"python benchmarks/vs_trl.py --workloads {args.workloads} --repeats {args.repeats} --layouts "
               f"{args.layouts} --precisions {args.precisions}" + (f" --baseline {args.baseline}" if args.baseline else ""))
    body = (f"Reproduce: `{command}` (measured {time.strftime('%Y-%m-%d')}; TRL 1.16.0 in its own venv).\n"
            "Phases: TRL `gen` = generation + reward + advantages, `train` = the rest of the step; rlframe "
            "`gen` includes the weight sync (`update_weights`, also shown alone), `other` = the step's time "
            "outside the workers' compute (`timing_s/overhead/total`: driver work, serialization, RPCs). Start-up = "
            "process launch to the first step's start (rlframe: `timing_s/startup/total`).\n\n" + "\n\n".join(bodies))
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
