"""Weight sync over the split placement's channel: full vs delta syncs, fp32 vs bf16 generation
weights, gloo vs shared-memory transport, on real training steps.

    python benchmarks/weight_sync.py [--preset 50m] [--steps 20] [--lr 1e-6] [--replicas 1] [--no-write]
    python benchmarks/weight_sync.py --fanout 1,2,4 [--preset 50m] [--repeats 5]
    python benchmarks/weight_sync.py --hosts --link-mbit 1000 [--fanout 1,2,4] [--steps 20]   # root

Rank 0 trains the preset's model (random init, fp32 AdamW at --lr, a cross-entropy step on a fresh
random batch each step: real gradients) and after every step syncs it to --replicas generation ranks
(tp 1: each holds the whole model) through `execute_plan` on a `P2PChannel`, as an actor sends to its
generation group. Per step, alternating in one run: for each generation dtype (fp32; bf16, the
master weights cast as the actor casts them) a full sync and a delta sync (rlframe/resharding/delta.py,
a full one every 10), over gloo and over shared-memory rings (which of the two goes first alternates
step by step: the sync right after another one's is slower, whatever the transport). Every delta sync is
checked bit-identical to
the full one of the same step. The first sync of each kind (a full one for delta) is left out of the
medians. The table: bytes sent per sync, changed fraction, time per sync (median and spread).

With --fanout: full bf16 syncs of the model from one training rank to R generation replicas (tp 1),
direct (the training rank sends every replica its slices) and chained (rollout.weight_fanout=chain:
sent once, forwarded replica to replica), alternating, --repeats times each, for each R; over shared
memory (rollout.weight_transport=shm).

With --hosts: the same two measurements between hosts made of network namespaces
(rlframe/utils/netns_hosts.py), each host's outgoing traffic capped at --link-mbit (a token bucket on
its interface, as a NIC's line rate), gloo between them: the trainer on h0, replica r on h(r+1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import machine_state, markdown_table, write_section  # noqa: E402

SECTION = "## Weight sync: delta and transports"
FANOUT_SECTION = "## Weight sync: fan-out to generation replicas"
HOSTS_SECTION = "## Weight sync between hosts with rate-limited links"
MB = 1e6


def _train_step(model, opt, vocab: int, g) -> None:
    import torch

    ids = torch.randint(4, vocab, (4, 128), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def _run(rank, world, path, steps, lr, ports, addr="127.0.0.1", kinds=("gloo", "shm")):
    import torch

    from rlframe.resharding.channel import P2PChannel
    from rlframe.resharding.delta import DeltaState
    from rlframe.resharding.layout import Layout
    from rlframe.resharding.planner import ParamMeta, plan_reshard

    torch.manual_seed(0)
    src, dst = Layout(dp=1, ranks=(0,)), Layout(tp=1, dp=world - 1, ranks=tuple(range(1, world)))
    model = opt = None
    if rank == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    else:
        shapes = None
    shapes = _broadcast(shapes)
    channels = {kind: P2PChannel(addr=addr, port=port, rank=rank, world_size=world, transport=kind)
                for kind, port in zip(kinds, ports)}
    runs = [(dtype, mode, kind) for dtype in ("float32", "bfloat16") for kind in kinds for mode in ("full", "delta")]
    plans = {d: plan_reshard({n: ParamMeta(s, getattr(torch, d)) for n, s in shapes.items()}, src=src, dst=dst)
             for d in ("float32", "bfloat16")}
    deltas = {r: DeltaState(full_every=10) for r in runs if r[1] == "delta"}
    rows = {r: {"times": [], "sent": [], "changed": [], "full_bytes": 0} for r in runs}
    mismatches = 0
    g = torch.Generator().manual_seed(1)
    for step in range(steps + 1):  # step 0: the initial weights
        if rank == 0 and step:
            _train_step(model, opt, model.config.vocab_size, g)
        for dtype in ("float32", "bfloat16"):
            local = ({n: p.detach().to(getattr(torch, dtype)).contiguous() for n, p in model.named_parameters()}
                     if rank == 0 else {})
            held = {}
            order = kinds if step % 2 == 0 else kinds[::-1]  # which transport goes first alternates by step
            for r in sorted((r for r in runs if r[0] == dtype), key=lambda r: order.index(r[2])):
                got = {}
                torch.distributed.barrier()
                t0 = time.perf_counter()
                stats = _sync(plans[dtype], local, channels[r[2]], deltas.get(r), got)
                torch.distributed.barrier()
                rows[r]["times"].append(time.perf_counter() - t0)
                d = deltas.get(r)
                rows[r]["sent"].append(d.stats.sent_bytes if d else stats.bytes_sent)
                rows[r]["changed"].append(d.stats.changed_fraction if d else 1.0)
                rows[r]["full_bytes"] = stats.bytes_sent
                if rank and r[1] == "full":
                    held[r[2]] = got
                elif rank:
                    mismatches += sum(not torch.equal(got[k], held[r[2]][k]) for k in got)
    return {"rows": rows, "mismatches": mismatches}


def _broadcast(obj):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sync(plan, local, channel, delta, got):
    from rlframe.resharding.executor import execute_plan

    def keep(pieces):
        for name, box, t in pieces:
            got[(name, box.offsets)] = t.clone()

    return execute_plan(plan, local=local, consumer=keep, channel=channel, delta=delta)


def _fanout(rank, world, path_shapes, repeats, ports, addr="127.0.0.1", transport="shm", bucket_mb=8):
    import torch

    from rlframe.resharding.channel import P2PChannel
    from rlframe.resharding.executor import execute_plan
    from rlframe.resharding.layout import Layout
    from rlframe.resharding.planner import ParamMeta, plan_reshard
    from rlframe.workers.weight_plan import relay_of, split_generation_layout

    shapes = path_shapes
    src = Layout(dp=1, ranks=(0,))
    metas = {n: ParamMeta(s, torch.bfloat16) for n, s in shapes.items()}
    g = torch.Generator().manual_seed(0)
    local = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()} if rank == 0 else {}
    plans = {chain: plan_reshard(metas, src=src, dst=split_generation_layout(src, tp=1, world=world - 1, chain=chain))
             for chain in (False, True)}
    relay = relay_of(src, tp=1, world=world - 1, channel_rank=rank) if rank else None
    channel = P2PChannel(addr=addr, port=ports[0], rank=rank, world_size=world, transport=transport)
    times = {False: [], True: []}
    for _ in range(repeats):
        for chain in (False, True):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            execute_plan(plans[chain], local=local, consumer=lambda pieces: None, channel=channel,
                         bucket_bytes=bucket_mb << 20, relay=relay if chain else None)
            torch.distributed.barrier()
            times[chain].append(time.perf_counter() - t0)
    return times


def _param_shapes(path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the model's parameters, read from its safetensors header."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def run_fanout(preset: str, replicas: list[int], repeats: int, bucket_mb: int) -> str:
    import tempfile

    import torch

    from rlframe.data.tiny_model import build_random_model, count_parameters
    from rlframe.utils.ports import free_port
    from rlframe.utils.spawn import run_distributed

    before = machine_state()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_model(Path(tmp) / preset, preset=preset, seed=0)
        shapes = _param_shapes(path)
    rows = fanout_rows({r: run_distributed(_fanout, world_size=1 + r, timeout_s=3600,
                                           args=(shapes, repeats, [free_port()], "127.0.0.1", "shm", bucket_mb))[0]
                        for r in replicas})
    after = machine_state()
    model_mb = sum(torch.Size(s).numel() for s in shapes.values()) * 2 / MB
    head = (f"Full bf16 syncs of the `{preset}` preset ({count_parameters(preset) / 1e6:.1f}M parameters, "
            f"{model_mb:.0f} MB) from one training rank to R generation replicas of tp 1 over shared memory "
            f"(buckets of {bucket_mb} MiB), direct and chained alternating, {repeats} times each; seconds per sync, median "
            f"(range), and the median against R = 1. 1 + R processes on this machine's 2 cores. fp32 matmul "
            f"{before['gflops']:.0f} GFLOP/s before, {after['gflops']:.0f} after; 1-minute load average "
            f"{before['load1']:.2f} before, {after['load1']:.2f} after.")
    return head + "\n\n" + markdown_table(["replicas R", "fan-out", "s per sync, median (range)", "vs R = 1"], rows)


def fanout_rows(by_replicas: dict) -> list[list]:
    """Table rows from {R: {chained: [seconds per sync]}}."""
    rows, base = [], {}
    for r, times in by_replicas.items():
        for chain in (False, True):
            t = times[chain]
            med = statistics.median(t)
            base.setdefault(chain, med)
            rows.append([r, "chain" if chain else "direct", f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})",
                         f"{med / base[chain]:.2f}x"])
            print(rows[-1], flush=True)
    return rows


def run(preset: str, steps: int, lr: float, replicas: int) -> str:
    import tempfile

    from rlframe.data.tiny_model import build_random_model, count_parameters
    from rlframe.utils.ports import free_ports
    from rlframe.utils.spawn import run_distributed

    before = machine_state()
    print(f"load {before['load1']:.2f}, fp32 matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_random_model(Path(tmp) / preset, preset=preset, seed=0))
        results = run_distributed(_run, world_size=1 + replicas, args=(path, steps, lr, free_ports(2)),
                                  timeout_s=3600)
    after = machine_state()
    table, mismatches = delta_rows(results)
    params = count_parameters(preset)
    head = (f"`{preset}` preset ({params / 1e6:.1f}M parameters), one training rank (fp32 AdamW, lr {lr:g}, a "
            f"cross-entropy step on a fresh random batch of 4 x 128 tokens per step) syncing to {replicas} generation "
            f"rank(s) over a P2PChannel after each of {steps} steps; medians over the syncs after the first (a delta "
            f"sync is a full one every 10th, included); gloo over loopback and shm rings (rollout.weight_transport=shm, "
            f"what auto picks for two ranks on one host), which one goes first alternating step by step. Every delta "
            f"sync's result equals the full sync's of the same "
            f"step bit for bit ({mismatches} mismatches). fp32 matmul {before['gflops']:.0f} GFLOP/s before, "
            f"{after['gflops']:.0f} after; 1-minute load average {before['load1']:.2f} before, {after['load1']:.2f} after.")
    return head + "\n\n" + markdown_table(DELTA_HEADER, table)


DELTA_HEADER = ["generation dtype", "transport", "sync", "full MB", "sent MB (median)", "of full",
                "changed words, median (range)", "s per sync, median (range)"]


def delta_rows(results: list[dict]) -> tuple[list[list], int]:
    """Table rows from every rank's `_run` result (the sender's rows), and the delta syncs that differed."""
    sender = results[0]["rows"]
    mismatches = sum(r["mismatches"] for r in results)
    table = []
    for (dtype, mode, kind), r in sender.items():
        skip = 1  # the first sync (the initial weights; dense for delta)
        times, sent = r["times"][skip:], r["sent"][skip:]
        changed = r["changed"][skip:]
        table.append([dtype.replace("float", "fp").replace("bfp16", "bf16"), kind, mode,
                      f"{r['full_bytes'] / MB:.1f}", f"{statistics.median(sent) / MB:.2f}",
                      f"{statistics.median(sent) / r['full_bytes']:.1%}",
                      f"{statistics.median(changed):.1%} ({min(changed):.1%}-{max(changed):.1%})" if mode == "delta" else "-",
                      f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"])
    return table, mismatches


def _worker(spec_path: str, rank: int) -> None:
    """One process of a --hosts run, on its host: join the run's process group over the host's
    interface, run its part, leave the result next to the spec."""
    import pickle

    import torch
    import torch.distributed as dist

    with open(spec_path, "rb") as fh:
        spec = pickle.load(fh)
    torch.set_num_threads(1)
    addr, world = spec["addr"], spec["world"]
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{spec['pg_port']}", rank=rank, world_size=world)
    if spec["mode"] == "fanout":
        out = _fanout(rank, world, spec["shapes"], spec["repeats"], spec["ports"], addr=addr, transport="gloo",
                      bucket_mb=spec["bucket_mb"])
    else:
        out = _run(rank, world, spec["path"], spec["steps"], spec["lr"], spec["ports"], addr=addr, kinds=("gloo",))
    dist.barrier()
    with open(f"{spec_path}.{rank}", "wb") as fh:
        pickle.dump(out, fh)
    dist.destroy_process_group()


def _on_hosts(hosts, spec: dict, work: Path, name: str) -> list:
    """Run the spec's processes on hosts 0 .. world - 1; every rank's result."""
    import pickle

    spec_path = work / name
    with open(spec_path, "wb") as fh:
        pickle.dump(spec, fh)
    procs = [hosts.popen(i, [sys.executable, __file__, "--worker", str(spec_path), "--rank", str(i)],
                         env={"GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": str(ROOT)}, cwd=str(ROOT))
             for i in range(spec["world"])]
    for p in procs:
        if p.wait(timeout=3600):
            raise RuntimeError(f"{name}: a process on the hosts failed (exit {p.returncode})")
    out = []
    for i in range(spec["world"]):
        with open(f"{spec_path}.{i}", "rb") as fh:
            out.append(pickle.load(fh))
    return out


def run_hosts(preset: str, replicas: list[int], steps: int, lr: float, repeats: int, mbit: float,
              bucket_mb: int) -> str:
    import tempfile

    import torch

    from rlframe.data.tiny_model import build_random_model, count_parameters
    from rlframe.utils.netns_hosts import NetnsHosts, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"--hosts needs network namespaces: {why}")
    before = machine_state()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp, NetnsHosts(1 + max(replicas)) as hosts:
        work = Path(tmp)
        path = str(build_random_model(work / preset, preset=preset, seed=0))
        shapes = _param_shapes(path)
        for i in range(hosts.n):
            hosts.limit_egress(i, mbit)
        common = {"addr": hosts.ip(0), "pg_port": 29400, "ports": [29401, 29402]}
        fan = {r: _on_hosts(hosts, {**common, "mode": "fanout", "world": 1 + r, "shapes": shapes, "repeats": repeats,
                                    "bucket_mb": bucket_mb}, work, f"fanout{r}")[0] for r in replicas}
        delta = _on_hosts(hosts, {**common, "mode": "delta", "world": 2, "path": path, "steps": steps, "lr": lr},
                          work, "delta")
    after = machine_state()
    model_mb = sum(torch.Size(s).numel() for s in shapes.values()) * 2 / MB
    table, mismatches = delta_rows(delta)
    params = count_parameters(preset)
    return "\n\n".join([
        f"Hosts made of network namespaces on this machine (rlframe/utils/netns_hosts.py), each host's outgoing "
        f"traffic capped at {mbit:g} Mbit/s (a token bucket on its interface), gloo between them; the `{preset}` preset "
        f"({params / 1e6:.1f}M parameters). fp32 matmul {before['gflops']:.0f} GFLOP/s before, {after['gflops']:.0f} "
        f"after; 1-minute load average {before['load1']:.2f} before, {after['load1']:.2f} after.",
        f"Fan-out: full bf16 syncs ({model_mb:.0f} MB) from the trainer on h0 to R replicas (tp 1, h1 .. hR), direct "
        f"and chained alternating, {repeats} times each (buckets of {bucket_mb} MiB: a chain of R replicas takes "
        f"about (buckets + R - 1) bucket times).",
        markdown_table(["replicas R", "fan-out", "s per sync, median (range)", "vs R = 1"], fanout_rows(fan)),
        f"Delta: the trainer on h0 trains (fp32 AdamW, lr {lr:g}, {steps} steps, a fresh random batch of 4 x 128 "
        f"tokens per step) and syncs to one replica on h1 after each step, full and delta alternating; every delta "
        f"sync's result equals the full sync's bit for bit ({mismatches} mismatches).",
        markdown_table(DELTA_HEADER, table)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="50m")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--fanout", default=None, help="comma-separated replica counts: measure fan-out instead")
    ap.add_argument("--hosts", action="store_true", help="between network-namespace hosts (root)")
    ap.add_argument("--link-mbit", type=float, default=1000.0)
    ap.add_argument("--bucket-mb", type=int, default=8, help="fan-out: bucket size")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.rank)
        return
    if args.hosts:
        replicas = [int(x) for x in (args.fanout or "1,2,4").split(",")]
        body = run_hosts(args.preset, replicas, args.steps, args.lr, args.repeats, args.link_mbit, args.bucket_mb)
        print(body)
        if not args.no_write:
            command = (f"python benchmarks/weight_sync.py --hosts --link-mbit {args.link_mbit:g} --fanout "
                       f"{','.join(map(str, replicas))} --preset {args.preset} --steps {args.steps} --lr {args.lr:g} "
                       f"--repeats {args.repeats} --bucket-mb {args.bucket_mb}")
            write_section(HOSTS_SECTION, f"Reproduce (as root): `{command}` (measured {time.strftime('%Y-%m-%d')})."
                          f"\n\n{body}")
        return
    if args.fanout:
        body = run_fanout(args.preset, [int(x) for x in args.fanout.split(",")], args.repeats, args.bucket_mb)
        print(body)
        if not args.no_write:
            command = (f"python benchmarks/weight_sync.py --fanout {args.fanout} --preset {args.preset} "
                       f"--repeats {args.repeats} --bucket-mb {args.bucket_mb}")
            write_section(FANOUT_SECTION, f"Reproduce: `{command}` (measured {time.strftime('%Y-%m-%d')}).\n\n{body}")
        return
    body = run(args.preset, args.steps, args.lr, args.replicas)
    print(body)
    if not args.no_write:
        command = (f"python benchmarks/weight_sync.py --preset {args.preset} --steps {args.steps} --lr {args.lr:g} "
                   f"--replicas {args.replicas}")
        write_section(SECTION, f"Reproduce: `{command}` (measured {time.strftime('%Y-%m-%d')}).\n\n{body}")


if __name__ == "__main__":
    main()
