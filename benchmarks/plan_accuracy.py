"""`rlframe plan`'s cost model against measured step times on this machine.

    python benchmarks/plan_accuracy.py [--steps 6] [--rounds 3] [--no-write]

Calibrates the constants once (`rlframe plan --calibrate` on configs/ppo_tiny.yaml as shipped:
colocated, 2 processes, the demo model), then runs each plan below for --steps steps, in --rounds
rounds that alternate the plans, and compares its measured step time (the median over the rounds of
each run's median step after the first) with the estimate: the tiny (demo)
and 12m presets, PPO and GRPO, 2 and 4 processes, colocated and split placement, synchronous and
asynchronous, fsdp and megatron-core, dp / tp / pp layouts and micro-batch sizes. Reported: each
plan's prediction and measurement, the Spearman rank correlation, the median absolute error, and
whether the plan predicted fastest measures within 10% of the fastest measured. A scatter plot goes
to docs/img/plan_accuracy.png. The load average and the fp32 matmul rate are printed before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import machine_state, markdown_table, reproduce_line, write_section  # noqa: E402

SECTION = "## Execution plans: estimated vs measured step time"
SPLIT_PPO = ["resources.placement=split", "+resources.split_procs={actor: 1, critic: 1, ref: 1, rollout: 1}",
             "actor.dp=1", "critic.dp=1", "resources.procs_per_node=4"]
SPLIT_GRPO = ["resources.placement=split", "+resources.split_procs={actor: 1, ref: 1, rollout: 2}", "actor.dp=1",
              "resources.procs_per_node=4"]
MEGATRON = ["actor.strategy=megatron", "critic.strategy=megatron"]
TWELVE = ["model.tiny_preset=12m", "data.train_batch_size=32", "actor.mini_batch_size=128"]
# (label, config, overrides): every one a valid plan of its config (the enumeration builds each)
PLANS = [
    ("ppo colocated 2: fsdp dp2, mb32", "ppo_tiny", []),
    ("ppo colocated 2: fsdp dp2, mb8", "ppo_tiny", ["actor.micro_batch_size=8", "critic.micro_batch_size=8"]),
    ("ppo colocated 2: fsdp tp2", "ppo_tiny", ["actor.dp=1", "actor.tp=2", "critic.dp=1", "critic.tp=2",
                                               "actor.micro_batch_size=64", "critic.micro_batch_size=64"]),
    ("ppo colocated 2: megatron dp2", "ppo_tiny", MEGATRON),
    ("ppo colocated 2: megatron tp2", "ppo_tiny", [*MEGATRON, "actor.dp=1", "actor.tp=2", "critic.dp=1", "critic.tp=2",
                                                   "actor.sequence_parallel=true", "critic.sequence_parallel=true",
                                                   "actor.micro_batch_size=64", "critic.micro_batch_size=64"]),
    ("ppo colocated 2: megatron pp2", "ppo_tiny", [*MEGATRON, "actor.dp=1", "actor.pp=2", "critic.dp=1", "critic.pp=2",
                                                   "actor.micro_batch_size=32", "critic.micro_batch_size=32"]),
    ("ppo colocated 4: fsdp dp4", "ppo_tiny", ["resources.procs_per_node=4", "actor.dp=4", "critic.dp=4"]),
    ("ppo split 4: one process a role", "ppo_tiny", SPLIT_PPO),
    ("ppo split 4, async k=1", "ppo_tiny", [*SPLIT_PPO, "trainer.max_staleness=1", "algorithm.off_policy_correction=tis"]),
    ("grpo 12m colocated 2: fsdp dp2", "grpo_tiny", TWELVE),
    ("grpo 12m colocated 2: megatron tp2", "grpo_tiny", [*TWELVE, "actor.strategy=megatron", "actor.dp=1", "actor.tp=2",
                                                         "actor.sequence_parallel=true"]),
    ("grpo 12m split 4: rollout on 2", "grpo_tiny", [*TWELVE, *SPLIT_GRPO]),
]
# plans across two hosts made of network namespaces (rlframe/utils/netns_hosts.py, root only): the
# hosts share this machine's cores, so the model is given each host's share; the link between them
# is measured like the local one (a two-rank gloo all-reduce, one rank in each host)
HOSTS = 2
HOST_CPUS = 4
HOST_JOB = ["rollout.kv_cache_bytes=33554432", "trainer.max_restarts=0"]
HOST_PLANS = [
    ("ppo 2 hosts: fsdp dp2, a rank on each", "ppo_tiny",
     ["resources.nodes=2", "resources.procs_per_node=1", "actor.dp=2", "critic.dp=2"]),
    ("ppo 2 hosts: megatron tp2 in a host, pp2 across", "ppo_tiny",
     ["resources.nodes=2", "resources.procs_per_node=2", *MEGATRON,
      *(f"{r}.{k}" for r in ("actor", "critic") for k in ("dp=1", "tp=2", "pp=2", "sequence_parallel=true",
                                                          "micro_batch_size=32"))]),
]
CALIBRATION = ("ppo_tiny", [])
# Measured runs, by what determines them (the committed code the runs execute, the cost model left
# out, the interpreter, the CPU, the command): a change to the cost model re-estimates without
# re-measuring. Ignored by git; a fresh clone measures everything.
RUNS = ROOT / "benchmarks" / ".plan_runs"


def runtime_version() -> str | None:
    """The committed files the runs execute: rlframe/ but its plan/ (except calibrate.py, which runs
    the profiles and the link probe), configs/, setup.py; None when they have changes."""
    git = ["git", "-C", str(ROOT)]
    paths = ["rlframe", "configs", "setup.py"]
    kept = lambda path: not path.startswith("rlframe/plan/") or path == "rlframe/plan/calibrate.py"  # noqa: E731
    dirty = subprocess.run([*git, "status", "--porcelain", "--", *paths], capture_output=True, text=True).stdout
    if any(kept(line[3:]) for line in dirty.splitlines()):
        return None
    tree = subprocess.run([*git, "ls-tree", "-r", "HEAD", "--", *paths], capture_output=True, text=True).stdout
    from rlframe.utils.machine import cpu_model

    lines = "\n".join(line for line in tree.splitlines() if kept(line.split("\t", 1)[1]))
    return hashlib.sha256(f"{lines}|{sys.executable}|{cpu_model()}".encode()).hexdigest()[:20]


def measured_rows(name: str, overrides: list[str], *, steps: int, round: int = 0) -> list[dict]:
    """The run's metrics rows after its first step (from RUNS when this code already ran it here)."""
    from rlframe.plan.calibrate import profile

    version = runtime_version()
    key = [version, name, overrides, steps] + ([round] if round else [])
    path = RUNS / (hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20] + ".json")
    if version is not None and path.is_file():
        return json.loads(path.read_text())
    rows = profile(name, overrides, steps=steps)
    if version is not None:
        RUNS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows))
    return rows


def measure_on_hosts(steps: int, rounds: int) -> dict:
    """{"link": (latency, bandwidth) between the hosts, label: [metrics rows after step 1, a list a
    round]} (from RUNS when this code already measured them here)."""
    from rlframe.plan.calibrate import QUIET, link_constants

    version = runtime_version()
    key = [version, "hosts", HOSTS, HOST_CPUS, HOST_PLANS, HOST_JOB, steps, rounds]
    path = RUNS / (hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20] + ".json")
    if version is not None and path.is_file():
        saved = json.loads(path.read_text())
        return {**saved, "link": link_constants({int(k): v for k, v in saved["probe"].items()})}
    import tempfile

    from rlframe.utils.netns_hosts import NetnsHosts

    out = {}
    with tempfile.TemporaryDirectory(prefix="rlframe-plan-hosts-") as tmp, NetnsHosts(HOSTS, cpus=HOST_CPUS) as cluster:
        probe = Path(tmp) / "link.json"
        code = ("from rlframe.plan.calibrate import link_worker; "
                f"link_worker({{rank}}, 29611, [4096, 8 << 20], 20, {str(probe)!r}, addr={cluster.ip(0)!r})")
        # gloo binds the interface of its hostname, which a host resolves to loopback: name the veth
        env = {"PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "eth0"}
        procs = [cluster.popen(i, [sys.executable, "-c", code.format(rank=i)], env=env) for i in range(2)]
        try:
            failed = [p.wait(timeout=300) for p in procs]
        except subprocess.TimeoutExpired:
            failed = [1]
        if any(failed):
            for p in procs:
                p.kill()
            raise RuntimeError("the link probe between the hosts failed or hung")
        out["probe"] = json.loads(probe.read_text())
        cluster.start_ray()
        for i in range(rounds):
            for label, name, overrides in HOST_PLANS:
                exp = f"hosts{i}_{len(out.get(label, []))}_{HOST_PLANS.index((label, name, overrides))}"
                job = cluster.run_job(name, [*overrides, *HOST_JOB, *QUIET, f"trainer.total_steps={steps}",
                                             f"trainer.output_dir={tmp}", f"trainer.experiment={exp}"],
                                      run_dir=Path(tmp) / exp, env={"PYTHONPATH": str(ROOT)})
                if job.returncode != 0:
                    raise RuntimeError(f"{label} failed:\n{job.stderr[-3000:]}")
                rows = [json.loads(line) for line in (Path(tmp) / exp / "metrics.jsonl").read_text().splitlines() if line.strip()]
                out.setdefault(label, []).append([r for r in rows if r.get("step", 0) >= 2 and "timing_s/step" in r])
    if version is not None:
        RUNS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out))
    return {**out, "link": link_constants({int(k): v for k, v in out["probe"].items()})}


def row(label: str, predicted: float, runs: list[float]) -> dict:
    measured = statistics.median(runs)
    print(f"  {label}: estimated {predicted:.3f} s, measured {measured:.3f} s "
          f"({min(runs):.3f}-{max(runs):.3f} over {len(runs)} runs)", flush=True)
    return {"label": label, "predicted": predicted, "measured": measured, "runs": runs}


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    xs, ys = [r["predicted"] for r in rows], [r["measured"] for r in rows]
    ax.scatter(xs, ys)
    for i, r in enumerate(rows, 1):
        ax.annotate(str(i), (r["predicted"], r["measured"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    top = max(xs + ys) * 1.1
    ax.plot([0, top], [0, top], color="gray", lw=0.8, ls="--", label="measured = estimated")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="estimated s per step", ylabel="measured s per step (median)",
           title="rlframe plan: estimate vs measurement")
    ax.legend(loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each plan, alternating: the median is reported")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--no-hosts", action="store_true", help="leave out the plans across network-namespace hosts")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from rlframe.config import load_config, validate
    from rlframe.plan.dry_run import model_dims
    from rlframe.plan.calibrate import calibrate, observed
    from rlframe.plan.cost import estimate

    before = machine_state()
    print(f"load {before['load1']:.1f}, fp32 matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    t0 = time.perf_counter()
    constants = calibrate(*CALIBRATION, log=lambda line: print("  " + line, flush=True),
                          run=lambda name, overrides: measured_rows(name, overrides, steps=4))
    print(f"calibrated in {time.perf_counter() - t0:.0f} s: {constants}", flush=True)
    runs: dict[str, list[float]] = {}
    for i in range(args.rounds):  # alternating: a slow minute of the machine touches every plan alike
        for label, name, overrides in PLANS:
            runs.setdefault(label, []).append(observed(measured_rows(name, overrides, steps=args.steps, round=i))["step"])
            print(f"  round {i + 1}: {label}: {runs[label][-1]:.3f} s", flush=True)
    rows = []
    for label, name, overrides in PLANS:
        cfg = validate(load_config(name, overrides))
        rows.append(row(label, estimate(cfg, model_dims(cfg), constants).total, runs[label]))
    from rlframe.utils.netns_hosts import unavailable

    why_not = "left out (--no-hosts)" if args.no_hosts else unavailable()
    if not why_not:
        hosts = measure_on_hosts(args.steps, args.rounds)
        latency, bandwidth = hosts["link"]
        print(f"  link between hosts: {latency * 1e6:.0f} us, {bandwidth / 1e9:.2f} GB/s", flush=True)
        # the namespace hosts share this machine's cores: each host gets its share
        shared = dataclasses.replace(constants, net_latency_s=latency, net_bandwidth=bandwidth,
                                     cores=constants.cores / HOSTS)
        for label, name, overrides in HOST_PLANS:
            cfg = validate(load_config(name, [*overrides, *HOST_JOB, "trainer.dry_run=true"]))  # no cluster here
            rows.append(row(label, estimate(cfg, model_dims(cfg), shared).total,
                            [observed(r)["step"] for r in hosts[label]]))
    after = machine_state()
    errors = [abs(r["predicted"] - r["measured"]) / r["measured"] for r in rows]
    rho = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
    chosen = min(rows, key=lambda r: r["predicted"])
    best = min(rows, key=lambda r: r["measured"])
    gap = chosen["measured"] / best["measured"] - 1
    table = markdown_table(["#", "plan", "estimated s per step", "measured s per step (min-max)", "error"],
                           [[i, r["label"], f"{r['predicted']:.3f}",
                             f"{r['measured']:.3f} ({min(r['runs']):.3f}-{max(r['runs']):.3f})",
                             f"{(r['predicted'] - r['measured']) / r['measured']:+.0%}"] for i, r in enumerate(rows, 1)])
    summary = (f"Spearman rank correlation {rho:.2f} (goal at least 0.8); median absolute error {statistics.median(errors):.0%} "
               f"(goal at most 25%); the plan estimated fastest ({chosen['label']}) measures {gap:+.0%} against the "
               f"fastest measured ({best['label']}) (goal within 10%).")
    print(table + "\n" + summary)
    body = "\n".join([
        reproduce_line(f"python benchmarks/plan_accuracy.py --steps {args.steps} --rounds {args.rounds}", before, after),
        "",
        f"Constants: `rlframe plan --calibrate` on {CALIBRATION[0]} as shipped ({constants.source}). Each plan ran "
        f"{args.steps} steps in each of {args.rounds} rounds that alternate the plans; measured = the median over "
        "the rounds of a run's median step time after its first step (the range: the rounds'). "
        + (f"Plans across hosts: {why_not}." if why_not else
           f"The last {len(HOST_PLANS)} plans run across {HOSTS} hosts made of network namespaces on this machine "
           "(docs/multinode.md), which share its cores (the model is told so: each host gets its share), with the "
           "link between the hosts measured by the same gloo probe (one rank in each host)."), "",
        table, "", summary, "", "![estimated vs measured step time](img/plan_accuracy.png)"])
    if not args.no_write:
        plot(rows, ROOT / "docs" / "img" / "plan_accuracy.png")
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
