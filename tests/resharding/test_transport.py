"""Every transport of the weight channel moves the same bytes (transport.py), on real processes.

Ranks 0-1 play the training group (FSDP dp2 shards), ranks 2-3 the generation group (tp2); one
channel per transport (gloo, shm, file, auto) runs the same cross-group plan with small buckets, and
each generation rank checks it holds exactly its slices; the shm channel then runs three delta syncs.
"""

import glob

import pytest
import torch

from rlframe.resharding.executor import assemble, execute_plan
from rlframe.resharding.layout import Layout
from rlframe.resharding.planner import plan_reshard
from rlframe.utils.ports import free_port, free_ports
from rlframe.utils.spawn import run_distributed
from tests.resharding.pairs import DIMS, full_weights, metas

SRC = Layout(tp=1, dp=2, fsdp=True, ranks=(0, 1))
DST = Layout(tp=2, dp=1, ranks=(2, 3))
KINDS = ("gloo", "shm", "file", "auto")


def _sync(channel, plan, full, rank, delta=None, relay=None, expected=None):
    """One sync of `full`'s slices (small buckets, both send paths): (whether this rank holds exactly
    its slices of `expected`, default `full`, in their dtype; the executor's stats)."""
    expected = full if expected is None else expected
    local = {n: full[n][b.slices()].clone() for (n, r), b in plan.src_boxes.items() if r == rank}
    got = {}

    def keep(pieces):
        for n, b, t in pieces:
            got.setdefault(n, []).append((n, b, t.clone()))

    stats = execute_plan(plan, local=local, consumer=keep, bucket_bytes=2048, zero_copy_min_bytes=64,
                         channel=channel, delta=delta, relay=relay)
    mine = relay.mirror if relay else rank  # a chained replica holds what the first replica's rank does
    boxes = {n: b for (n, r), b in plan.dst_boxes.items() if r == mine}
    held = assemble(got, boxes) if boxes else {}
    exact = all(held[n].dtype == expected[n].dtype and torch.equal(held[n], expected[n][b.slices()])
                for n, b in boxes.items())
    return exact, stats


def _rings(channel, rank):
    """Ranks 0 and 2 send each other 60 messages through the shm rings at once, each side posting all of
    its sends and receives first and waiting on the receives last to first: sizes from 0 bytes to 3x the
    first ring, rings capped at twice the first (they wrap around, grow to the cap, a larger message gets
    a ring of its own, and a sender waits for room while the other side reads), int64 and uint8 messages.
    Whether every message arrives whole and in its place; then rank 0 fails in the middle of a send and
    rank 2, waiting for it, raises with rank 0's reason."""
    from rlframe.resharding.transport import MIN_RING

    if rank not in (0, 2):
        return True
    channel.transport.max_ring = 2 * MIN_RING
    peer, g = 2 - rank, torch.Generator().manual_seed(11)
    sizes = [int(x) for x in torch.randint(0, MIN_RING // 3, (60,), generator=g)]
    sizes[7], sizes[30], sizes[31] = 0, 3 * MIN_RING, MIN_RING + 1

    def message(src, i):
        n = sizes[i]
        return torch.arange(n // 8, dtype=torch.int64) * (src + 1) + i if i % 2 else \
            (torch.arange(n, dtype=torch.int64) * 7 + src + i).to(torch.uint8)

    sends = [message(rank, i) for i in range(60)]
    got = [torch.empty_like(message(peer, i)) for i in range(60)]
    reqs = []
    for i in range(0, 60, 4):  # in batches, sends and receives interleaved
        ops = [op for j in range(i, i + 4) for op in ((True, sends[j], peer), (False, got[j], peer))]
        reqs += channel.start(ops)
    for req in reversed(reqs):
        req.wait()
    exact = all(torch.equal(got[i], message(peer, i)) for i in range(60))
    if rank == 0:
        channel.transport._place = lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        try:
            channel.start([(True, torch.ones(8, dtype=torch.uint8), 2)])
        except OSError:
            return exact
        return False
    try:
        channel.start([(False, torch.empty(8, dtype=torch.uint8), 0)])[0].wait()
    except RuntimeError as err:
        return exact and "rank 0 failed while sending to rank 2" in str(err) and "No space left" in str(err)
    return False


def _run(rank, world, ports, directory):
    from rlframe.resharding.channel import P2PChannel
    from rlframe.resharding.delta import DeltaState

    plan = plan_reshard(metas(), src=SRC, dst=DST, num_layers=DIMS.num_layers)
    full = full_weights(seed=3)
    out = {}
    for kind, port in zip(KINDS, ports[:-1]):
        channel = P2PChannel(addr="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=60,
                             transport=kind, directory=directory)
        out[kind] = _sync(channel, plan, full, rank)[0]
        if kind == "shm":
            delta, ok = DeltaState(full_every=5), []
            g = torch.Generator().manual_seed(0)
            for _ in range(3):
                ok.append(_sync(channel, plan, full, rank, delta)[0])
                full = {n: torch.where(torch.rand(t.shape, generator=g) < 0.02, t + 1, t) for n, t in full.items()}
            out["shm_delta"] = all(ok)
            out["rings"] = _rings(channel, rank)
        torch.distributed.barrier()  # every rank done with this channel's files
        if kind == "shm":  # every ring was mapped by its receiver, which removed its file
            out["shm_left"] = glob.glob(channel.transport.prefix + "*")
    # fp32 shards, a bf16 plan: each piece is cast as it is sent (packed or straight from the shard)
    from rlframe.resharding.planner import ParamMeta

    bf16 = plan_reshard({n: ParamMeta(m.shape, torch.bfloat16) for n, m in metas().items()}, src=SRC, dst=DST,
                        num_layers=DIMS.num_layers)
    fp32 = {n: t.float() for n, t in full_weights(seed=6).items()}
    out["cast"] = _sync(channel, bf16, fp32, rank, expected={n: t.bfloat16() for n, t in fp32.items()})[0]
    try:
        P2PChannel(addr="127.0.0.1", port=ports[-1], rank=rank, world_size=world, timeout_s=60, transport="nccl")
        out["nccl"] = "built"
    except ValueError as e:
        out["nccl"] = str(e)
    return out


def test_every_transport_moves_the_same_bytes(tmp_path):
    ports = free_ports(len(KINDS) + 1)  # the last for the nccl attempt
    results = run_distributed(_run, world_size=4, args=(ports, str(tmp_path)), timeout_s=240)
    for rank, res in enumerate(results):
        assert all(res[k] for k in KINDS), (rank, res)
        assert res["shm_delta"] and res["rings"] and res["shm_left"] == [] and res["cast"], (rank, res)
        if not torch.distributed.is_nccl_available():
            assert "is_nccl_available() is False" in res["nccl"], res["nccl"]
    assert list(tmp_path.rglob("*.safetensors")) == []  # every file message was read and removed


def _chain(rank, world, port, replicas):
    """Ranks 0-1 train (dp2), then `replicas` generation replicas of tp2: the plan covers the first
    replica only; the others get the same slices passed along the chain (full syncs, then delta)."""
    from rlframe.resharding.channel import P2PChannel
    from rlframe.resharding.delta import DeltaState
    from rlframe.workers.weight_plan import relay_of, split_generation_layout

    first = split_generation_layout(SRC, tp=2, world=2 * replicas, chain=True)
    plan = plan_reshard(metas(), src=SRC, dst=first, num_layers=DIMS.num_layers)
    relay = relay_of(SRC, tp=2, world=2 * replicas, channel_rank=rank) if rank >= 2 else None
    # auto, with rank 3 short of shared memory (it asks for more room than any host has): its pairs go
    # over gloo, every other pair over shm rings, in one channel
    channel = P2PChannel(addr="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=60, transport="auto",
                         ring_room=1 << 62 if rank == 3 else 1 << 20)
    full, g = full_weights(seed=4), torch.Generator().manual_seed(5)  # the same on every rank
    out = [type(channel.transport).__name__]
    for delta in (None, DeltaState(full_every=3)):
        for _ in range(2 if delta is not None else 1):
            exact, stats = _sync(channel, plan, full, rank, delta, relay)
            out.append({"exact": exact, "sent": stats.bytes_sent})
            full = {n: t + (torch.rand(t.shape, generator=g) < 0.05) for n, t in full.items()}
    torch.distributed.barrier()  # rank 0 holds the channel's store until every rank is done
    return out


def test_chained_replicas_get_what_direct_sends_give():
    replicas = 2
    results = run_distributed(_chain, world_size=2 + 2 * replicas, args=(free_port(), replicas), timeout_s=240)
    assert [kinds for kinds, *_ in results] == ["PairTransport"] * 3 + ["ProcessGroupTransport"] + \
        ["PairTransport"] * (2 * replicas - 2)
    results = [syncs for _, *syncs in results]
    for rank, syncs in enumerate(results):
        assert all(s["exact"] for s in syncs), (rank, syncs)
    plan = plan_reshard(metas(), src=SRC, dst=DST, num_layers=DIMS.num_layers)
    once = sum(plan.bytes_received(r) for r in (2, 3))
    # the training ranks send each slice once, whatever the number of replicas; replicas but the last forward
    assert sum(results[r][0]["sent"] for r in (0, 1)) == once
    # a forwarding rank counts what it passes on: its slices' bytes, as its tp position receives them
    forwarded = [plan.bytes_received(2 + (r - 2) % 2) for r in range(2, 2 * replicas)] + [0, 0]
    assert [results[r][0]["sent"] for r in range(2, 2 + 2 * replicas)] == forwarded
