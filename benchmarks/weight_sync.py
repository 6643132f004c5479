"""Weight sync over the split placement's channel: full vs delta syncs, fp32 vs bf16 generation
weights, gloo vs shared-memory transport, on real training steps.

    python benchmarks/weight_sync.py [--preset 50m] [--steps 20] [--lr 1e-6] [--replicas 1] [--no-write]
    python benchmarks/weight_sync.py --fanout 1,2,4 [--preset 50m] [--repeats 5]

Rank 0 trains the preset's model (random init, fp32 AdamW at --lr, a cross-entropy step on a fresh
random batch each step: real gradients) and after every step syncs it to --replicas generation ranks
(tp 1: each holds the whole model) through `execute_plan` on a `P2PChannel`, as an actor sends to its
generation group. Per step, alternating in one run: for each generation dtype (fp32; bf16, the
master weights cast as the actor casts them) a full sync and a delta sync (rlframe/resharding/delta.py,
a full one every 10), over gloo and over shared memory. Every delta sync is checked bit-identical to
the full one of the same step. The first sync of each kind (a full one for delta) is left out of the
medians. The table: bytes sent per sync, changed fraction, time per sync (median and spread).

With --fanout: full bf16 syncs of the model from one training rank to R generation replicas (tp 1),
direct (the training rank sends every replica its slices) and chained (rollout.weight_fanout=chain:
sent once, forwarded replica to replica), alternating, --repeats times each, for each R; over shared
memory (rollout.weight_transport=shm).
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
MB = 1e6


def _train_step(model, opt, vocab: int, g) -> None:
    import torch

    ids = torch.randint(4, vocab, (4, 128), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def _run(rank, world, path, steps, lr, ports):
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
    channels = {kind: P2PChannel(addr="127.0.0.1", port=port, rank=rank, world_size=world, transport=kind)
                for kind, port in zip(("gloo", "shm"), ports)}
    runs = [(dtype, mode, kind) for dtype in ("float32", "bfloat16") for kind in ("gloo", "shm")
            for mode in ("full", "delta")]
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
            for r in (r for r in runs if r[0] == dtype):
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


def _fanout(rank, world, path_shapes, repeats, ports):
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
    channel = P2PChannel(addr="127.0.0.1", port=ports[0], rank=rank, world_size=world, transport="shm")
    times = {False: [], True: []}
    for _ in range(repeats):
        for chain in (False, True):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            execute_plan(plans[chain], local=local, consumer=lambda pieces: None, channel=channel,
                         bucket_bytes=32 << 20, relay=relay if chain else None)
            torch.distributed.barrier()
            times[chain].append(time.perf_counter() - t0)
    return times


def run_fanout(preset: str, replicas: list[int], repeats: int) -> str:
    import tempfile

    import torch

    from rlframe.data.tiny_model import build_random_model, count_parameters
    from rlframe.utils.spawn import free_port, run_distributed

    before = machine_state()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_model(Path(tmp) / preset, preset=preset, seed=0)
        from safetensors import safe_open

        with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    rows, base = [], {}
    for r in replicas:
        times = run_distributed(_fanout, world_size=1 + r, args=(shapes, repeats, [free_port()]), timeout_s=3600)[0]
        for chain in (False, True):
            t = times[chain]
            med = statistics.median(t)
            base.setdefault(chain, med)
            rows.append([r, "chain" if chain else "direct", f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})",
                         f"{med / base[chain]:.2f}x"])
            print(rows[-1], flush=True)
    after = machine_state()
    model_mb = sum(torch.Size(s).numel() for s in shapes.values()) * 2 / MB
    head = (f"Full bf16 syncs of the `{preset}` preset ({count_parameters(preset) / 1e6:.1f}M parameters, "
            f"{model_mb:.0f} MB) from one training rank to R generation replicas of tp 1 over shared memory "
            f"(buckets of 32 MiB), direct and chained alternating, {repeats} times each; seconds per sync, median "
            f"(range), and the median against R = 1. 1 + R processes on this machine's 2 cores. fp32 matmul "
            f"{before['gflops']:.0f} GFLOP/s before, {after['gflops']:.0f} after; 1-minute load average "
            f"{before['load1']:.2f} before, {after['load1']:.2f} after.")
    return head + "\n\n" + markdown_table(["replicas R", "fan-out", "s per sync, median (range)", "vs R = 1"], rows)


def run(preset: str, steps: int, lr: float, replicas: int) -> str:
    import tempfile

    from rlframe.data.tiny_model import build_random_model, count_parameters
    from rlframe.utils.spawn import free_port, run_distributed

    before = machine_state()
    print(f"load {before['load1']:.2f}, fp32 matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_random_model(Path(tmp) / preset, preset=preset, seed=0))
        results = run_distributed(_run, world_size=1 + replicas, args=(path, steps, lr, [free_port(), free_port()]),
                                  timeout_s=3600)
    after = machine_state()
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
    params = count_parameters(preset)
    head = (f"`{preset}` preset ({params / 1e6:.1f}M parameters), one training rank (fp32 AdamW, lr {lr:g}, a "
            f"cross-entropy step on a fresh random batch of 4 x 128 tokens per step) syncing to {replicas} generation "
            f"rank(s) over a P2PChannel after each of {steps} steps; medians over the syncs after the first (a delta "
            f"sync is a full one every 10th, included). Every delta sync's result equals the full sync's of the same "
            f"step bit for bit ({mismatches} mismatches). fp32 matmul {before['gflops']:.0f} GFLOP/s before, "
            f"{after['gflops']:.0f} after; 1-minute load average {before['load1']:.2f} before, {after['load1']:.2f} after.")
    return head + "\n\n" + markdown_table(
        ["generation dtype", "transport", "sync", "full MB", "sent MB (median)", "of full", "changed words, median (range)",
         "s per sync, median (range)"], table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="50m")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--fanout", default=None, help="comma-separated replica counts: measure fan-out instead")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.fanout:
        body = run_fanout(args.preset, [int(x) for x in args.fanout.split(",")], args.repeats)
        print(body)
        if not args.no_write:
            command = f"python benchmarks/weight_sync.py --fanout {args.fanout} --preset {args.preset} --repeats {args.repeats}"
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
