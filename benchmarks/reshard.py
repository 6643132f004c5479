"""Resharding training -> generation weights: rlframe's plan vs the peers' gather-everything schemes.

Model: the parameter shapes of the "100m" preset (rlframe/data/tiny_model.py; Qwen2, 104M parameters,
fp32, random values), on 4 gloo processes. Every method ends in the same state: each rank holds,
in preallocated generation tensors, exactly the box of every parameter its generation rank needs.

  (a) rlframe: `plan_reshard` + `execute_plan` (buckets of 256 MB or 32 MB, batched isend/irecv per peer);
  (b) all-gather: every full tensor is all-gathered on every rank, one tensor at a time, and each
      rank keeps its slice (verl's FSDP -> vLLM weight sync);
  (c) broadcast: rank 0 gathers each full tensor and broadcasts it to all ranks, one at a time
      (OpenRLHF's ZeRO-3 -> vLLM sync).

Bytes are counted by each method as it receives them; time is the slowest rank's, one run each.
Run: `python benchmarks/reshard.py` (writes the "## Resharding" section of docs/benchmarks.md;
`--no-write` only prints the table).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import report  # noqa: E402
from rlframe.resharding import Layout, ModelDims, ParamMeta, execute_plan, hf_param_shapes  # noqa: E402
from rlframe.resharding import hybridflow_generation_layout, plan_reshard  # noqa: E402

WORLD = 4
BUCKET = 256 << 20
MB = 1e6


def model_dims() -> ModelDims:
    from rlframe.data.tiny_model import PRESETS
    from rlframe.data.tokenizer import build_char_tokenizer

    s = PRESETS["100m"]
    return ModelDims(num_layers=s.num_layers, hidden_size=s.hidden_size, num_heads=s.num_heads,
                     num_kv_heads=s.num_kv_heads, intermediate_size=s.intermediate_size,
                     vocab_size=len(build_char_tokenizer()), qkv_bias=True)


def scenarios() -> list[tuple[str, Layout, Layout]]:
    fsdp = Layout(dp=4, fsdp=True)
    megatron = Layout(tp=4)
    return [
        ("FSDP dp=4 -> vLLM tp=2 (dp=2)", fsdp, Layout(tp=2, dp=2)),
        ("Megatron tp=4 -> tp=2, HybridFlow strided", megatron, hybridflow_generation_layout(megatron, tp=2)),
        ("FSDP dp=4 -> tp=1 (full copy per rank)", fsdp, Layout(dp=4)),
    ]


def full_param(name: str, shape, index: int) -> torch.Tensor:
    """Deterministic random values of one full parameter (same on every rank, made on demand)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + index))


def _padded_shard(name, meta, src: Layout, local, rank):
    """Every rank's box of `name` and this rank's shard flattened and zero-padded to the largest
    shard's size n (the collectives need equal sizes on every rank)."""
    boxes = [src.box(name, meta.shape, r) for r in range(WORLD)]
    n = max(b.numel if b else 0 for b in boxes)
    mine = torch.zeros(n)
    if boxes[rank]:
        mine[:boxes[rank].numel] = local[name].reshape(-1)
    return boxes, n, mine


def _assemble(meta, boxes, parts) -> torch.Tensor:
    """The full tensor from every rank's padded flat shard."""
    full = torch.empty(meta.shape)
    for b, p in zip(boxes, parts):
        if b:
            full[b.slices()] = p[:b.numel].view(b.sizes)
    return full


def _all_gather_full(name, meta, src: Layout, local, rank):
    """Full tensor on every rank via one all_gather of padded flat shards (received bytes returned)."""
    boxes, n, mine = _padded_shard(name, meta, src, local, rank)
    parts = [torch.empty(n) for _ in range(WORLD)]
    dist.all_gather(parts, mine)
    full = _assemble(meta, boxes, parts)
    return full, (WORLD - 1) * n * 4, (WORLD + 1) * n * 4 + full.numel() * 4


def _gather_broadcast_full(name, meta, src: Layout, local, rank):
    """Full tensor on every rank: rank 0 gathers the padded flat shards, then broadcasts it."""
    boxes, n, mine = _padded_shard(name, meta, src, local, rank)
    parts = [torch.empty(n) for _ in range(WORLD)] if rank == 0 else None
    dist.gather(mine, parts, dst=0)
    full = _assemble(meta, boxes, parts) if rank == 0 else torch.empty(meta.shape)
    dist.broadcast(full, src=0)
    got = (WORLD - 1) * n * 4 if rank == 0 else full.numel() * 4
    return full, got, (WORLD + 1) * n * 4 + full.numel() * 4 if rank == 0 else n * 4 + full.numel() * 4


def _baseline(fetch, metas, src, dst, local, gen, rank) -> dict:
    received = peak = 0
    t0 = time.perf_counter()
    for name, meta in metas.items():
        full, got, held = fetch(name, meta, src, local, rank)
        received += got
        peak = max(peak, held)
        gen[name].copy_(full[dst.box(name, meta.shape, rank).slices()])
    return {"time_s": time.perf_counter() - t0, "received": received, "peak": peak, "messages": len(metas)}


def _rlframe(metas, src, dst, local, gen, rank, *, bucket_bytes: int = BUCKET) -> dict:
    # The plan depends only on the two layouts and the shapes: built once, reused at every sync.
    t0 = time.perf_counter()
    plan = plan_reshard(metas, src=src, dst=dst)
    plan_s = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()

    def consumer(pieces):
        for name, box, t in pieces:
            gen[name][box.relative_to(dst.box(name, metas[name].shape, rank)).slices()].copy_(t)

    st = execute_plan(plan, local=local, consumer=consumer, bucket_bytes=bucket_bytes)
    return {"time_s": time.perf_counter() - t0, "plan_s": plan_s, "received": st.bytes_received,
            "peak": st.peak_extra_bytes, "messages": st.num_messages, "buckets": st.num_buckets}


def _check(metas, dst, gen, rank) -> bool:
    ok = True
    for i, (name, meta) in enumerate(metas.items()):
        ok &= torch.equal(gen[name], full_param(name, meta.shape, i)[dst.box(name, meta.shape, rank).slices()])
    return ok


def worker(rank: int, world_size: int) -> list[dict]:
    shapes = hf_param_shapes(model_dims())
    metas = {n: ParamMeta(s, torch.float32) for n, s in shapes.items()}
    out = []
    for label, src, dst in scenarios():
        local = {}
        for i, (n, s) in enumerate(shapes.items()):
            b = src.box(n, s, rank)
            if b is not None:
                local[n] = full_param(n, s, i)[b.slices()].clone()
        for method, run in (("(a) rlframe plan, 256 MB buckets", _rlframe),
                            ("(a) rlframe plan, 32 MB buckets", lambda *a: _rlframe(*a, bucket_bytes=32 << 20)),
                            ("(b) all-gather every full tensor", lambda *a: _baseline(_all_gather_full, *a)),
                            ("(c) rank-0 gather + broadcast", lambda *a: _baseline(_gather_broadcast_full, *a))):
            gen = {n: torch.zeros(dst.box(n, m.shape, rank).sizes) for n, m in metas.items()}
            dist.barrier()
            res = run(metas, src, dst, local, gen, rank)
            dist.barrier()
            res.update(scenario=label, method=method, ok=_check(metas, dst, gen, rank))
            out.append(res)
            del gen
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-write", action="store_true", help="print the table, leave docs/benchmarks.md alone")
    args = p.parse_args()
    from rlframe.utils.spawn import run_distributed

    load_before = os.getloadavg()[0]
    per_rank = run_distributed(worker, world_size=WORLD, timeout_s=1800, env={"RLFRAME_THREADS_PER_RANK": "1"})
    load_after = os.getloadavg()[0]
    n_params = sum(torch.Size(s).numel() for s in hf_param_shapes(model_dims()).values())
    rows = []
    for i, first in enumerate(per_rank[0]):
        rs = [per_rank[r][i] for r in range(WORLD)]
        assert all(r["ok"] for r in rs), f"{first['scenario']} / {first['method']}: wrong weights"
        rows.append([first["scenario"], first["method"], f"{max(r['time_s'] for r in rs):.2f}",
                     f"{max(r['received'] for r in rs) / MB:.1f}", f"{sum(r['received'] for r in rs) / MB:.1f}",
                     f"{max(r['peak'] for r in rs) / MB:.1f}", max(r["messages"] for r in rs),
                     f"{max(r['plan_s'] for r in rs):.2f}" if "plan_s" in first else "-"])
    table = report.markdown_table(
        ["training -> generation", "method", "time s (slowest rank)", "received MB (max rank)",
         "received MB (all ranks)", "peak extra MB", "messages/collectives per rank",
         "plan s (once, cached)"], rows)
    body = (f"Model: parameter shapes of the `100m` preset ({n_params / 1e6:.1f}M parameters, fp32, "
            f"{n_params * 4 / MB:.0f} MB), random values; {WORLD} gloo processes on one machine, 1 thread each; "
            "one run per row. Every method ends with each rank holding exactly its generation slice "
            "(checked bit for bit). (a) rlframe: bucketed batched isend/irecv of a plan built once per layout pair "
            "(planning time in its own column); "
            "(b) all-gather of every full tensor on every rank, one tensor at a time (verl); "
            "(c) rank-0 gather then broadcast of every full tensor (OpenRLHF).\n"
            f"{report.machine_line()} The machine was shared with other jobs (1-minute load average "
            f"{load_before:.0f} before, {load_after:.0f} after, on 2 cores): times of one run vary up to 2x "
            "between runs; bytes are exact and repeatable.\n\n"
            f"Reproduce: `python benchmarks/reshard.py`\n\n{table}\n\n"
            "Received MB: bytes that arrived over the network (rlframe counts payload only; reused local "
            "bytes are not received). Peak extra MB: rlframe's one buffer arena (packed sends + receives "
            "of its largest bucket; contiguous pieces are sent straight from the shard); for (b)/(c) the "
            "shard copies plus one full tensor. On CPU the time goes to memory copies (packing strided "
            "pieces, gloo's TCP loopback copies in and out of the kernel, the consumer's copy) and to 4 ranks "
            "sharing 2 cores, not to the network. 32 MB buckets were faster than 256 MB in most rows over "
            "three runs (a smaller arena takes fewer first-touch page faults), not in all. Where every rank "
            "needs the whole model (FSDP -> tp=1) no scheme can receive fewer bytes, and the three methods "
            "are within run-to-run noise.\n")
    print(table)
    if not args.no_write:
        report.write_section("## Resharding", body)


if __name__ == "__main__":
    main()
