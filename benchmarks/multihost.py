"""The main job on 1, 2 and 3 hosts made of network namespaces (rlframe/utils/netns_hosts.py).

    sudo python benchmarks/multihost.py [--steps 4] [--cases fsdp-dp2,megatron-tp2-pp2]

For each host count a cluster of that many hosts is built (a Ray head in h0, a worker node in each
other host, every host its own network, /dev/shm and hostname), and each case runs the main job
(PPO with a critic on the tiny demo model, temperature 0.8, two mini-batches per step) with the layout spread over the hosts:
`resources.nodes` = hosts, so each node's group is on a host of its own. The same layout on one host
is the reference: the table gives the step time (median of steps 2..N), the bytes all hosts sent
over the network per step (veth counters, steps 1..N), and whether every metric of every step equals
the one-host run's. Printed, and written to docs/benchmarks.md ("## Multi-host").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlframe.jobs import read_metrics  # noqa: E402
from report import machine_line, machine_state, markdown_table, write_section  # noqa: E402

SECTION = "## Multi-host"
NONDETERMINISTIC = ("timing_s/", "perf/", "async/gen_start_unix", "async/gen_end_unix")  # clocks
CONFIG = "ppo_tiny"
JOB = ["model.tiny_preset=demo", "data.train_batch_size=16", "data.response_length=6", "data.val_size=16",
       "rollout.temperature=0.8", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
       "critic.mini_batch_size=8", "critic.micro_batch_size=4", "ref.enabled=false", "trainer.val_every=0",
       "trainer.save_every=0",
       "trainer.export_hf=false", "trainer.loggers=[jsonl]", "trainer.plot=false", "trainer.progress_bar=false",
       "rollout.val_n=2", "rollout.kv_cache_bytes=33554432", "trainer.max_restarts=0"]
HOST_CPUS = 4
# case: (what it shows, overrides, {hosts: layout overrides}); one host is always the reference
CASES = {
    "fsdp-dp2": ("fsdp dp2: one rank per host", ["actor.dp=2", "critic.dp=2"],
                 {1: ["resources.nodes=1", "resources.procs_per_node=2"],
                  2: ["resources.nodes=2", "resources.procs_per_node=1"]}),
    "fsdp-dp3": ("fsdp dp3: one rank per host", ["actor.dp=3", "critic.dp=3", "data.train_batch_size=24",
                                                 "actor.mini_batch_size=12", "critic.mini_batch_size=12"],
                 {1: ["resources.nodes=1", "resources.procs_per_node=3"],
                  3: ["resources.nodes=3", "resources.procs_per_node=1"]}),
    "megatron-tp2-pp2": ("megatron tp2 within a host, pp2 across",
                         [f"{role}.{k}" for role in ("actor", "critic") for k in ("strategy=megatron", "dp=1", "tp=2", "pp=2")],
                         {1: ["resources.nodes=1", "resources.procs_per_node=4"],
                          2: ["resources.nodes=2", "resources.procs_per_node=2"]}),
    # a process takes a whole host's CPUs, so actor, critic and generation group are on 3 hosts
    "split": ("split: actor, critic and generation on a host each",
              ["resources.placement=split", "actor.dp=1", "critic.dp=1", "+resources.split_procs={actor: 1, rollout: 1}",
               f"resources.cpus_per_proc={HOST_CPUS}", "resources.procs_per_node=1"],
              {1: [], 3: []}),
}


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = read_metrics(run_dir)
    return {r["step"]: r for r in rows}


def compare(one: dict[int, dict], many: dict[int, dict]) -> str:
    """"yes" when every deterministic metric of every step is equal, else the largest difference
    (relative, and absolute for values below 1e-3 such as the log-prob gaps, which measure float
    noise themselves) and the keys that differ."""
    worst, differ = 0.0, set() if sorted(one) == sorted(many) else {"steps"}
    for step in one:
        for key, value in one[step].items():
            if key.startswith(NONDETERMINISTIC) or key == "step":
                continue
            other = many.get(step, {}).get(key)
            if other != value:
                differ.add(key)
                if isinstance(other, (int, float)) and isinstance(value, (int, float)):
                    worst = max(worst, abs(other - value) / max(abs(value), 1e-3))
                else:
                    worst = float("inf")
    if not differ:
        return "yes"
    keys = sorted(differ)
    return f"no: max diff {worst:.1e} in {', '.join(keys[:4])}" + (f" (+{len(keys) - 4})" if len(keys) > 4 else "")


LOSS_JOB = ["resources.nodes=2", "resources.procs_per_node=1", "actor.dp=2", "critic.dp=2", "trainer.save_every=2",
            "resources.node_wait_s=120", "trainer.max_restarts=1"]
LOSSES = {"back once the driver waits for it": [], "elastic: go on with 1 host": ["resources.elastic=true"]}


def node_loss(cluster, root: Path, *, steps: int) -> list[list]:
    """The 2-host fsdp run, uninterrupted and with the paused rank's host killed in step 3: the host
    comes back after 3 s (the run waits for it), or stays down (resources.elastic: dp 2 -> 1)."""
    import subprocess
    import time

    base = JOB + LOSS_JOB + [f"trainer.total_steps={steps}", f"trainer.output_dir={root}"]
    reference = cluster.run_job(CONFIG, base + ["trainer.experiment=loss-reference"],
                                run_dir=root / "loss-reference", env={"PYTHONPATH": os.getcwd()})
    assert reference.returncode == 0, reference.stderr[-3000:]
    rows = []
    for i, (what, extra) in enumerate(LOSSES.items()):
        name = f"loss-{i}"
        argv = [sys.executable, "-m", "rlframe.main", "--config-name", CONFIG, f"ray.address={cluster.ray_address}",
                *base, *extra, f"trainer.experiment={name}",
                "actor.worker_cls=tests.controller.trainers.faulty_workers:NodeLostOnceActor"]
        with open(root / f"{name}.out", "w") as out:
            proc = cluster.popen(0, argv, env={"PYTHONPATH": os.getcwd()}, stdout=out, stderr=subprocess.STDOUT)
            marker, metrics_file = root / name / "node-lost-once", root / name / "metrics.jsonl"
            while not marker.exists() and proc.poll() is None:
                time.sleep(0.1)
            host = int(marker.read_text().strip()[1:])
            killed = time.monotonic()
            cluster.kill_node(host)
            if not extra:  # the host comes back once the driver waits for it
                while proc.poll() is None and "waiting up to" not in (root / f"{name}.out").read_text():
                    time.sleep(0.1)
                cluster.start_node(host)
            while proc.poll() is None and '"step": 3' not in (metrics_file.read_text() if metrics_file.exists() else ""):
                time.sleep(0.1)
            recovered = time.monotonic() - killed
            proc.wait(timeout=600)
        if extra:
            cluster.start_node(host)
            cluster.wait_nodes(cluster.n)
        said = [ln for ln in (root / f"{name}.out").read_text().splitlines()
                if "lost " in ln or "room for the run again" in ln]
        same = compare(metrics(root / "loss-reference"), metrics(root / name)) if proc.returncode == 0 else "-"
        said = [line.replace("[rlframe] ", "").split(" (worker group")[0][:160] for line in said]
        rows.append([what, proc.returncode, f"{recovered:.1f}", same, " / ".join(said)])
        print(rows[-1], flush=True)
    return rows


def run_cluster(hosts: int, cases: list[str], *, steps: int, root: Path) -> dict[tuple[str, int], dict]:
    from rlframe.utils.netns_hosts import NetnsHosts

    out = {}
    with NetnsHosts(hosts, cpus=HOST_CPUS * (3 if hosts == 1 else 1)) as cluster:
        cluster.start_ray()
        for case in (c for c in cases if c in CASES):
            _, overrides, layouts = CASES[case]
            if hosts not in layouts:
                continue
            name = f"{case}-{hosts}h"
            job = cluster.run_job(CONFIG, JOB + overrides + layouts[hosts] + [
                f"trainer.total_steps={steps}", f"trainer.output_dir={root}", f"trainer.experiment={name}"],
                run_dir=root / name, env={"PYTHONPATH": os.getcwd()})
            if job.returncode != 0:
                print(job.stdout[-2000:], job.stderr[-4000:], flush=True)
                out[(case, hosts)] = {"error": job.stderr.strip().splitlines()[-1][:200] if job.stderr.strip() else "?"}
                continue
            rows = metrics(root / name)
            times = [rows[s]["timing_s/step"] for s in sorted(rows) if s >= 2]
            out[(case, hosts)] = {"rows": rows, "step_s": statistics.median(times), "spread": (min(times), max(times)),
                                  "bytes": job.bytes_per_step(), "seconds": job.seconds}
            print(case, hosts, out[(case, hosts)]["step_s"], out[(case, hosts)]["bytes"], flush=True)
        if hosts == 2 and "node-loss" in cases:
            out["node-loss"] = node_loss(cluster, root, steps=steps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cases", default=",".join([*CASES, "node-loss"]))
    p.add_argument("--root", default=None, help="keep the runs' directories here (default: a temporary one)")
    args = p.parse_args()
    from rlframe.utils.netns_hosts import unavailable

    if why := unavailable():
        sys.exit(f"multihost benchmark: {why}")
    cases = args.cases.split(",")
    before = machine_state()
    results = {}
    with tempfile.TemporaryDirectory(prefix="rlframe-multihost-") as tmp:
        root = Path(args.root or tmp)
        for hosts in (1, 2, 3):
            if any(hosts in CASES[c][2] for c in cases if c in CASES) or (hosts == 2 and "node-loss" in cases):
                results.update(run_cluster(hosts, cases, steps=args.steps, root=root))
    after = machine_state()
    table = []
    for case in (c for c in cases if c in CASES):
        what, _, layouts = CASES[case]
        one = results.get((case, 1), {})
        for hosts in sorted(layouts):
            r = results.get((case, hosts), {})
            if "error" in r or not r:
                table.append([what, hosts, "error: " + r.get("error", "did not run"), "-", "-", "-"])
                continue
            same = "reference" if hosts == 1 else compare(one["rows"], r["rows"])
            table.append([what, hosts, f"{r['step_s']:.2f} ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})",
                          f"{(r['bytes'] or 0) / 2**20:.2f}", same, f"{r['seconds']:.0f}"])
    text = "\n\n".join([
        f"`sudo python benchmarks/multihost.py --steps {args.steps}` (root: network namespaces). Hosts are network "
        "namespaces on this one machine (docs/multinode.md): each has its own network (a veth to a bridge), /dev/shm "
        "and hostname, and runs a Ray node; they share the machine's cores, so a step on more hosts is not faster "
        "here, and the bytes are what a real network would carry. The job: PPO with a critic (GAE) on the tiny demo "
        "model, 16 prompts per step, temperature 0.8, two mini-batches per step, fp32, 5 steps.",
        machine_line(note=f"load average {before['load1']:.1f} before, {after['load1']:.1f} after; fp32 matmul "
                          f"{before['gflops']:.0f} GFLOP/s"),
        markdown_table(["layout", "hosts", "s/step median (min-max)", "MiB sent per step", "metrics equal to 1 host",
                        "job s"], table),
    ] + ([
        "A host lost mid-step: the fsdp dp2 run on 2 hosts (checkpoints at steps 2 and 4), one rank paused in step 3's "
        "actor update while its host's raylet and every process on it are SIGKILLed. Recovery is the time from the "
        "kill to step 3's metrics of the resumed run; the metrics are compared with the same run uninterrupted. "
        "Elastic goes on at dp 1: the same samples, but each rank shuffles its own share into mini-batches, so with "
        "two mini-batches per step a mini-batch holds other samples at dp 1 than at dp 2, and the updates differ "
        "(with one mini-batch per step, step 3's losses agree to 5e-5 relative and every step's rewards are the "
        "same).",
        markdown_table(["what happened to the host", "exit code", "s from kill to step 3 done", "metrics equal to "
                        "uninterrupted", "what the driver said"], results["node-loss"]),
    ] if "node-loss" in results else []))
    print(text)
    if args.cases == p.get_default("cases"):
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
