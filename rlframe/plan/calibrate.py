"""The cost model's constants, measured on this machine (`rlframe plan --calibrate`).

Three kinds of measurement:
- the compute rate of one process alone: a matmul in the compute dtype on one thread (workers run
  one thread each on CPUs), best of several;
- the links: a two-process gloo all-reduce of a small and a large tensor (latency and bandwidth);
- the rest by fitting: the config is run for a few steps in a few colocated variants (as given,
  half the micro-batch, twice the batch, and where the engines allow it half the dp as tp), and the
  phases' timers (median over the steps after the first) fit the model's linear constants (the
  inverse efficiencies of training, forward and decode passes, and the fixed costs per call,
  micro-batch, decode step and tensor-parallel collective) by least squares with non-negative
  coefficients. The responses' mean length gives `response_fill`.

The idle link probe sees a tensor-parallel collective's hops but not what each costs inside a
training pass (DTensor dispatch, autograd, a rank waiting on the slower one): the tp profile fits
that as `tp_call_s`; without one (a single process, or a model tp cannot split) it stays 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlframe.plan.cost import Constants, CostModel

# the constants the fit sets, each with its coefficient in the model (linear in it)
FITTED = ("train_eff", "infer_eff", "decode_eff", "call_s", "micro_s", "decode_s")
TENSOR_PARALLEL = "tp_call_s"  # fitted too when a profile runs tensor parallelism
INVERSE = {"train_eff", "infer_eff", "decode_eff"}  # the model divides by these: it is linear in 1 / x
PHASES = ("gen", "ref", "old_log_prob", "values", "update_critic", "update_actor")
QUIET = ["trainer.save_every=0", "trainer.export_hf=false", "trainer.plot=false", "trainer.resume=off",
         "trainer.progress_bar=false", "trainer.loggers=[jsonl]", "trainer.val_every=0",
         "trainer.auto_plan=false"]  # a profile runs the layout it is fitted with


def compute_rate(dtype: str = "float32") -> float:
    """FLOP/s of a matmul on one thread, as a worker computes (startup.matmul_rates: best of several)."""
    import torch

    from rlframe.utils.startup import matmul_rates

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = matmul_rates(repeats=10)
    finally:
        torch.set_num_threads(threads)
    return (bf16 if dtype == "bfloat16" else fp32) * 1e9


def link_worker(rank: int, port: int, sizes: list[int], repeats: int, out: str, addr: str = "127.0.0.1") -> None:
    """One of the two ranks of the link probe (rank 0 listens at addr:port and writes the medians)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2)
    result = {}
    for size in sizes:
        t = torch.ones(size // 4)
        dist.all_reduce(t)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        result[size] = statistics.median(times)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def link(small: int = 4096, large: int = 8 << 20, repeats: int = 20) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of one hop between two processes of this host, from a gloo
    all-reduce of `small` and `large` bytes (2 processes: 2 hops, each moving half the bytes)."""
    import torch.multiprocessing as mp

    from rlframe.utils.ports import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "link.json")
        mp.start_processes(link_worker, args=(port, [small, large], repeats, out), nprocs=2, start_method="spawn")
        times = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    return link_constants(times)


def link_constants(times: dict[int, float]) -> tuple[float, float]:
    """(latency per hop, bandwidth) from a two-rank all-reduce's median seconds at two sizes:
    t(bytes) = 2 latency + 2 / 2 * bytes / bandwidth."""
    small, large = sorted(times)
    bandwidth = (large - small) / max(times[large] - times[small], 1e-9)
    latency = max(times[small] - small / bandwidth, 0.0) / 2
    return latency, bandwidth


def variants(cfg) -> list[list[str]]:
    """The profiled runs: the config as given, half its micro-batches (counted by rows), twice its
    batch, and its trained roles with half the dp as tp where the engines build that."""
    def half(role: str) -> list[str]:
        r = getattr(cfg, role)
        rows = r.micro_batch_size or r.rows_per_rank
        return [f"{role}.micro_batch_size={max(1, rows // 2)}", f"{role}.max_tokens_per_micro_batch=null"]

    out = [[], [*half("actor"), *half("critic")], [f"data.train_batch_size={cfg.data.train_batch_size * 2}"]]
    tp = tensor_parallel_variant(cfg)
    return out + [tp] if tp else out


def tensor_parallel_variant(cfg) -> list[str]:
    """Overrides moving a factor 2 of each trained role's dp to tp, or [] where an engine refuses it."""
    from rlframe.plan.dry_run import model_dims
    from rlframe.plan.space import model_type_of, engine_accepts

    dims, out = model_dims(cfg), []
    for name in ("actor", "critic") if cfg.uses_critic else ("actor",):
        r = getattr(cfg, name)
        if r.dp % 2 or r.sp > 1 or not engine_accepts(r.strategy, r.tp * 2, r.pp, dims, model_type_of(cfg)):
            return []
        out += [f"{name}.dp={r.dp // 2}", f"{name}.tp={r.tp * 2}"]
    return out


def check_profilable(cfg) -> None:
    """The fit needs phases that run one after another (colocated, synchronous) on this host's CPUs."""
    problems = []
    if cfg.resources.use_gpu:
        problems.append("GPU configs are not calibrated yet (the rate and link probes measure CPUs); use "
                        "--constants h100-assumed or a constants file")
    if cfg.resources.placement != "colocated" or cfg.trainer.max_staleness > 0:
        problems.append("calibrate on a colocated synchronous config (resources.placement=colocated, "
                        "trainer.max_staleness=0): there the phases run one after another and each timer is "
                        "its own phase; the constants then serve every plan")
    if cfg.resources.nodes > 1:
        problems.append("calibrate on one host (resources.nodes=1); between hosts the model takes "
                        "net_latency_s / net_bandwidth from the constants file")
    if problems:
        raise ValueError("rlframe plan --calibrate: " + "; ".join(problems))


def profile(name: str, overrides: list[str], *, steps: int = 4, config_path: str | None = None) -> list[dict]:
    """Run the main job `steps` steps: each step's metrics row after the first (start-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "rlframe.main", "--config-name", name, *([f"--config-path={config_path}"] if config_path else []),
               *overrides, *QUIET, f"trainer.total_steps={steps}", f"trainer.output_dir={tmp}", "trainer.experiment=calibrate"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"calibration run failed ({' '.join(overrides)}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "calibrate" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) >= 2 and "timing_s/step" in r]


def observed(rows: list[dict]) -> dict[str, float]:
    """Median seconds per phase over the rows; gen without the weight sync its timer includes."""
    out = {}
    for phase in PHASES:
        key = f"timing_s/{phase}"
        if all(key in r for r in rows):
            out[phase] = statistics.median(r[key] - (r.get("timing_s/update_weights", 0.0) if phase == "gen" else 0.0)
                                           for r in rows)
    out["step"] = statistics.median(r["timing_s/step"] for r in rows)
    return out


def with_coefficients(base: Constants, x: dict[str, float]) -> Constants:
    """`base` with the fitted constants set from their model coefficients (1 / efficiency)."""
    return dataclasses.replace(base, **{k: (1.0 / v if v > 0 else float("inf")) if k in INVERSE else v
                                        for k, v in x.items()})


def nnls(a, y):
    """min ||a x - y|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    import numpy as np

    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        w = a.T @ (y - a @ x)
        if passive.all() or w[~passive].max(initial=0.0) <= 1e-12 * max(1.0, abs(w).max()):
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit(samples: list[tuple[object, dict[str, float]]], dims, base: Constants) -> tuple[Constants, float]:
    """Least squares with non-negative coefficients of the FITTED constants (and `tp_call_s` when a
    sample runs tensor parallelism) over (config, observed phases) pairs; the model is linear in them
    (compute / efficiency, fixed costs times counts). Returns the constants and the median relative
    error of the fitted phases."""
    import numpy as np

    def phases(cfg, x: dict[str, float]) -> dict[str, float]:
        return CostModel(cfg, dims, with_coefficients(base, x)).step().phases

    names = FITTED + ((TENSOR_PARALLEL,) if any(max(cfg.actor.tp, cfg.critic.tp) > 1 for cfg, _ in samples) else ())
    zero = {k: 0.0 for k in names}
    rows, target = [], []
    for cfg, seen in samples:
        at0 = phases(cfg, zero)
        cols = {k: phases(cfg, {**zero, k: 1.0}) for k in names}
        for p in PHASES:
            if seen.get(p, 0.0) > 0 and p in at0:  # a phase the run has (a zero timer: it waited on none)
                w = 1.0 / max(seen[p], 1e-3)  # relative errors: every phase counts alike
                rows.append([(cols[k][p] - at0[p]) * w for k in names])
                target.append((seen[p] - at0[p]) * w)
    coef = nnls(np.array(rows), np.array(target))
    # an efficiency whose coefficient is 0 was not identified (its compute would be free): keep base's
    coef = [c if (c > 0 or k not in INVERSE) else 1.0 / getattr(base, k) for k, c in zip(names, coef.tolist())]
    fitted = with_coefficients(base, dict(zip(names, coef)))
    errors = [abs(CostModel(cfg, dims, fitted).step().phases[p] - seen[p]) / seen[p]
              for cfg, seen in samples for p in PHASES if p in seen and seen[p] > 0]
    return fitted, statistics.median(errors) if errors else float("nan")


def calibrate(name: str, overrides: list[str], *, config_path: str | None = None, log=print, run=None) -> Constants:
    """Measure and fit the constants for `name` with `overrides` on this machine; `run(name,
    overrides)` gives a profile's rows (default: `profile`, the main job run here)."""
    from rlframe.config import load_config, validate
    from rlframe.plan.dry_run import model_dims, runtime_dtype
    from rlframe.utils.machine import cpu_model

    cfg = validate(load_config(name, overrides, extra_dir=config_path))
    check_profilable(cfg)
    dtype = str(runtime_dtype(cfg)).removeprefix("torch.")
    flops = compute_rate(dtype)
    log(f"compute: {flops / 1e9:.1f} GFLOP/s per process ({dtype}, one thread)")
    latency, bandwidth = link()
    log(f"link: {latency * 1e6:.0f} us latency, {bandwidth / 1e9:.2f} GB/s (gloo, two processes)")
    cores = float(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else float(os.cpu_count() or 1)
    dims = model_dims(cfg)
    samples, lengths = [], []
    for extra in variants(cfg):
        t0 = time.perf_counter()
        rows = (run or (lambda n, o: profile(n, o, config_path=config_path)))(name, [*overrides, *extra])
        run_cfg = validate(load_config(name, [*overrides, *extra], extra_dir=config_path))
        samples.append((run_cfg, observed(rows)))
        lengths += [r["response_length/mean"] / run_cfg.data.response_length for r in rows if "response_length/mean" in r]
        log(f"profiled {' '.join(extra) or 'as given'}: {samples[-1][1]['step']:.3f} s per step "
            f"({time.perf_counter() - t0:.0f} s)")
    base = Constants(flops=flops, cores=cores,
                     latency_s=latency, bandwidth=bandwidth,
                     response_fill=statistics.median(lengths) if lengths else 1.0)
    fitted, err = fit(samples, dims, base)
    stamp = time.strftime("%Y-%m-%d")
    return dataclasses.replace(fitted, source=f"calibrated {stamp} on {cpu_model()} with {name} "
                               f"({len(samples)} profiles, median phase error {err:.0%})")
