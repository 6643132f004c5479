"""The main job on 1, 2 and 3 hosts made of network namespaces (rlframe/utils/netns_hosts.py).

    sudo python benchmarks/multihost.py [--steps 4] [--cases fsdp-dp2,megatron-tp2-pp2]

For each host count a cluster of that many hosts is built (a Ray head in h0, a worker node in each
other host, every host its own network, /dev/shm and hostname), and each case runs the GRPO job
(tiny demo model, temperature 0.8, two mini-batches per step) with the layout spread over the hosts:
`resources.nodes` = hosts, so each node's group is on a host of its own. The same layout on one host
is the reference: the table gives the step time (median of steps 2..N), the bytes all hosts sent
over the network per step (veth counters, steps 1..N), and whether every metric of every step equals
the one-host run's. Printed, and written to docs/benchmarks.md ("## Multi-host").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from report import machine_line, machine_state, markdown_table, write_section  # noqa: E402

SECTION = "## Multi-host"
NONDETERMINISTIC = ("timing_s/", "perf/")
JOB = ["model.tiny_preset=demo", "data.train_batch_size=4", "data.response_length=6", "data.val_size=16",
       "rollout.temperature=0.8", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
       "algorithm.use_kl_loss=false", "ref.enabled=false", "trainer.val_every=0", "trainer.save_every=0",
       "trainer.export_hf=false", "trainer.loggers=[jsonl]", "trainer.plot=false", "trainer.progress_bar=false",
       "rollout.val_n=2", "rollout.kv_cache_bytes=33554432", "trainer.max_restarts=0"]
HOST_CPUS = 4
# case: (what it shows, overrides, {hosts: layout overrides}); one host is always the reference
CASES = {
    "fsdp-dp2": ("fsdp dp2: one rank per host", ["actor.dp=2"],
                 {1: ["resources.nodes=1", "resources.procs_per_node=2"],
                  2: ["resources.nodes=2", "resources.procs_per_node=1"]}),
    "fsdp-dp3": ("fsdp dp3: one rank per host", ["actor.dp=3", "data.train_batch_size=6", "actor.mini_batch_size=12"],
                 {1: ["resources.nodes=1", "resources.procs_per_node=3"],
                  3: ["resources.nodes=3", "resources.procs_per_node=1"]}),
    "megatron-tp2-pp2": ("megatron tp2 within a host, pp2 across", ["actor.strategy=megatron", "actor.dp=1", "actor.tp=2",
                                                                    "actor.pp=2"],
                         {1: ["resources.nodes=1", "resources.procs_per_node=4"],
                          2: ["resources.nodes=2", "resources.procs_per_node=2"]}),
    # a process takes a whole host's CPUs, so the actor and the generation group are on different hosts
    "split": ("split: actor on one host, generation on another",
              ["resources.placement=split", "actor.dp=1", "+resources.split_procs={actor: 1, rollout: 1}",
               f"resources.cpus_per_proc={HOST_CPUS}", "resources.procs_per_node=1"],
              {1: [], 2: []}),
}


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def compare(one: dict[int, dict], many: dict[int, dict]) -> str:
    """"yes" when every deterministic metric of every step is equal, else the largest relative
    difference and the keys that differ."""
    worst, differ = 0.0, set() if sorted(one) == sorted(many) else {"steps"}
    for step in one:
        for key, value in one[step].items():
            if key.startswith(NONDETERMINISTIC) or key == "step":
                continue
            other = many.get(step, {}).get(key)
            if other != value:
                differ.add(key)
                if isinstance(other, (int, float)) and isinstance(value, (int, float)):
                    worst = max(worst, abs(other - value) / max(abs(value), 1e-12))
                else:
                    worst = float("inf")
    if not differ:
        return "yes"
    keys = sorted(differ)
    return f"no: max rel diff {worst:.1e} in {', '.join(keys[:4])}" + (f" (+{len(keys) - 4})" if len(keys) > 4 else "")


def run_cluster(hosts: int, cases: list[str], *, steps: int, root: Path) -> dict[tuple[str, int], dict]:
    from rlframe.utils.netns_hosts import NetnsHosts

    out = {}
    with NetnsHosts(hosts, cpus=HOST_CPUS * (3 if hosts == 1 else 1)) as cluster:
        cluster.start_ray()
        for case in cases:
            _, overrides, layouts = CASES[case]
            if hosts not in layouts:
                continue
            name = f"{case}-{hosts}h"
            job = cluster.run_job("grpo_tiny", JOB + overrides + layouts[hosts] + [
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
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cases", default=",".join(CASES))
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
            if any(hosts in CASES[c][2] for c in cases):
                results.update(run_cluster(hosts, cases, steps=args.steps, root=root))
    after = machine_state()
    table = []
    for case in cases:
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
        "here, and the bytes are what a real network would carry. The job: GRPO on the tiny demo model, temperature "
        "0.8, two mini-batches per step, fp32.",
        machine_line(note=f"load average {before['load1']:.1f} before, {after['load1']:.1f} after; fp32 matmul "
                          f"{before['gflops']:.0f} GFLOP/s"),
        markdown_table(["layout", "hosts", "s/step median (min-max)", "MiB sent per step", "metrics equal to 1 host",
                        "job s"], table),
    ])
    print(text)
    if args.cases == ",".join(CASES):
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
