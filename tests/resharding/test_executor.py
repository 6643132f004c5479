"""Executor on real gloo processes: every layout pair, bit-exact slices, measured accounting.

One 8-process spawn runs all pairs (a spawn costs seconds; a pair costs milliseconds). Each rank
returns, per pair, what it verified and its measured `ReshardStats`; the assertions on the
accounting run here against references computed independently of the planner.
"""

import pytest
import torch

from rlframe.resharding.box import Box
from rlframe.resharding.executor import assemble, execute_plan
from rlframe.resharding.formats import ModelDims
from rlframe.resharding.layout import Layout, hf_tp_split_dim, training_box
from rlframe.resharding.planner import plan_reshard
from rlframe.utils.spawn import run_distributed
from tests.resharding.pairs import DIMS, full_weights, layout_pairs, metas, vllm_like_box
from tests.resharding.test_planner import minimum_bytes

BUCKET = 1024  # bytes: small, so most tensors are split over several buckets


def _one_pair(rank: int, src, dst, full, dst_box=None) -> dict:
    plan = plan_reshard(metas(), src=src, dst=dst, num_layers=DIMS.num_layers, dst_box=dst_box)
    local = {n: full[n][b.slices()].clone() for (n, r), b in plan.src_boxes.items() if r == rank}
    got, calls, zero_copy = {}, [0], [True]

    def consumer(pieces):
        calls[0] += 1
        for name, box, t in pieces:
            assert tuple(t.shape) == box.sizes
            held = plan.src_boxes.get((name, rank))
            if held is not None and held.contains(box):  # reused piece: must alias the local shard
                zero_copy[0] &= t.untyped_storage().data_ptr() == local[name].untyped_storage().data_ptr()
            got.setdefault(name, []).append((name, box, t.clone()))

    # 64 bytes: the larger contiguous pieces go zero-copy, the rest packed, so both paths run
    stats = execute_plan(plan, local=local, consumer=consumer, bucket_bytes=BUCKET, zero_copy_min_bytes=64)
    boxes = {n: b for (n, r), b in plan.dst_boxes.items() if r == rank}
    coverage = {n: sum(b.numel for _, b, _ in got.get(n, [])) == box.numel for n, box in boxes.items()}
    out = assemble(got, boxes) if all(coverage.values()) else {}
    exact = bool(out) or not boxes
    for n, box in boxes.items():
        exact &= n in out and torch.equal(out[n], full[n][box.slices()])
    return {"exact": exact, "coverage": all(coverage.values()), "names": sorted(boxes) == sorted(got),
            "zero_copy": zero_copy[0], "calls": calls[0], "stats": stats.as_dict()}


def fsdp2_tp_mismatches(rank: int) -> list[str]:
    """Build HF-named modules, apply DTensor TP + FSDP2 on a (dp=2, tp=2) mesh, compare local shards.

    Runs on 8 ranks as two independent (dp=2, tp=2) replicas of a (2, 2, 2) mesh."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dims = ModelDims(num_layers=1, hidden_size=16, num_heads=4, num_kv_heads=2, intermediate_size=24,
                     vocab_size=30, qkv_bias=True)
    torch.manual_seed(0)
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
    layer = nn.Module()
    layer.self_attn, layer.mlp = nn.Module(), nn.Module()
    for proj, out in (("q", 16), ("k", 8), ("v", 8)):
        setattr(layer.self_attn, f"{proj}_proj", nn.Linear(16, out, bias=True))
    layer.self_attn.o_proj = nn.Linear(16, 16, bias=False)
    layer.mlp.gate_proj, layer.mlp.up_proj = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
    layer.mlp.down_proj = nn.Linear(24, 16, bias=False)
    layer.input_layernorm = nn.LayerNorm(16, bias=False)
    model.model.layers = nn.ModuleList([layer])
    model.model.norm = nn.LayerNorm(16, bias=False)
    model.lm_head = nn.Linear(16, dims.vocab_size, bias=False)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replica", "dp", "tp"))  # tp fastest: Megatron order
    plan = {"model.embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel()}
    plan.update({f"model.layers.0.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"})
    plan.update({f"model.layers.0.mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")})
    plan.update({"model.layers.0.self_attn.o_proj": RowwiseParallel(), "model.layers.0.mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    first = rank // 4 * 4
    lay = Layout(tp=2, dp=2, fsdp=True, ranks=tuple(range(first, first + 4)))
    bad = []
    for name, p in model.named_parameters():
        local = p.to_local()
        box = training_box(name, full[name].shape, lay, rank)
        ref = full[name][box.slices()] if box is not None else full[name].new_empty((0,) + full[name].shape[1:])
        if local.shape != ref.shape or not torch.equal(local, ref):
            bad.append(f"{name}: local {tuple(local.shape)} vs box {box}")
    return bad


def _delta_syncs(rank: int, src, dst, dst_box=None) -> list[dict]:
    """Six syncs of changing weights with a DeltaState (full every 4th): after each, every rank holds
    exactly what a full sync moves. Weights: random; then 1% of the elements changed; none; half;
    1% again (the fifth sync is a full one); 1% (sparse after a full sync that overwrote the copies)."""
    from rlframe.resharding.delta import DeltaState

    plan = plan_reshard(metas(), src=src, dst=dst, num_layers=DIMS.num_layers, dst_box=dst_box)
    state = DeltaState(full_every=4)
    g = torch.Generator().manual_seed(7)
    full, out = full_weights(seed=1), []
    for fraction in (None, 0.01, 0.0, 0.5, 0.01, 0.01):
        if fraction:
            full = {n: torch.where(torch.rand(t.shape, generator=g) < fraction, torch.randn(t.shape, generator=g).to(t.dtype), t)
                    for n, t in full.items()}
        local = {n: full[n][b.slices()].clone() for (n, r), b in plan.src_boxes.items() if r == rank}
        got = {}
        execute_plan(plan, local=local, consumer=lambda ps: [got.setdefault(n, []).append((n, b, t.clone()))
                                                              for n, b, t in ps],
                     bucket_bytes=BUCKET, zero_copy_min_bytes=64, delta=state)
        boxes = {n: b for (n, r), b in plan.dst_boxes.items() if r == rank}
        held = assemble(got, boxes) if boxes else {}
        s = state.stats
        out.append({"exact": all(torch.equal(held[n], full[n][b.slices()]) for n, b in boxes.items()),
                    "sent": s.sent_bytes, "full": s.full_bytes, "sparse": s.sparse_messages,
                    "messages": s.messages, "changed": s.changed_fraction})
    return out


def _all_pairs(rank: int, world_size: int) -> dict:
    full = full_weights(seed=1)
    pairs = [_one_pair(rank, src, dst, full) for _, src, dst, _ in layout_pairs()]
    custom = _one_pair(rank, Layout(tp=2, dp=2, fsdp=True), Layout(tp=4), full, dst_box=vllm_like_box)
    delta = _delta_syncs(rank, Layout(tp=2, dp=4, fsdp=True), Layout(tp=4, dp=2))
    return {"pairs": pairs, "custom": custom, "fsdp2": fsdp2_tp_mismatches(rank), "delta": delta}


@pytest.fixture(scope="module")
def spawned():
    """One 8-rank gloo run: every layout pair, then the FSDP2 + DTensor TP shard check."""
    return run_distributed(_all_pairs, world_size=8, timeout_s=240)


@pytest.fixture(scope="module")
def results(spawned):
    """results[i][rank] for pair i of layout_pairs()."""
    return [[spawned[r]["pairs"][i] for r in range(8)] for i in range(len(layout_pairs()))]


def test_custom_destination_rule_moves_exact_slices(spawned):
    """vLLM-style vocabulary padding and kv-head replication (planner's dst_box) on real ranks."""
    for rank in range(4):
        res = spawned[rank]["custom"]
        assert res["names"] and res["coverage"] and res["exact"] and res["zero_copy"], (rank, res)


def test_training_box_matches_real_fsdp2_plus_dtensor_tp_shards(spawned):
    """The boxes the planner assumes are the shards torch's FSDP2 + DTensor TP really keep (uneven vocab)."""
    assert [r["fsdp2"] for r in spawned] == [[]] * 8


PAIRS = layout_pairs()
IDS = [p[0] for p in PAIRS]


@pytest.mark.parametrize("i", range(len(PAIRS)), ids=IDS)
def test_every_rank_gets_exactly_its_generation_slice(results, i):
    for rank, res in enumerate(results[i]):
        assert res["names"] and res["coverage"] and res["exact"], (IDS[i], rank, res)
        assert res["zero_copy"], (IDS[i], rank, "reused pieces must be views of the local shard")


@pytest.mark.parametrize("i", range(len(PAIRS)), ids=IDS)
def test_measured_bytes_are_the_minimum_and_peak_is_one_bucket(results, i):
    _, src, dst, _ = PAIRS[i]
    for rank, res in enumerate(results[i]):
        s = res["stats"]
        assert s["bytes_received"] == minimum_bytes(src, dst, rank), (IDS[i], rank, s)
        assert s["peak_extra_bytes"] <= BUCKET, (IDS[i], rank, s)
        need = sum(b.numel * metas()[n].itemsize for n, m in metas().items()
                   for b in [dst.box(n, m.shape, rank, num_layers=DIMS.num_layers)] if b is not None)
        assert s["bytes_received"] + s["bytes_reused"] == need
    assert sum(r["stats"]["bytes_sent"] for r in results[i]) == sum(r["stats"]["bytes_received"] for r in results[i])


def _split_bytes() -> int:
    return sum(Box.full(m.shape).numel * m.itemsize for n, m in metas().items() if hf_tp_split_dim(n) is not None)


@pytest.mark.parametrize("i", [i for i, p in enumerate(PAIRS) if p[3] and p[1].pp == 1], ids=lambda i: IDS[i])
def test_hybridflow_pairs_receive_table2_amount(results, i):
    """HybridFlow Table 2: each rank receives (d_g - 1)/(t*p) of the (TP-split part of the) model.

    FSDP sources also shard the replicated tensors over dp, so there a rank receives what its
    generation shard needs minus its 1/(t*d) training shard: S/t_g + R - (S/t + R)/d.
    """
    _, src, dst, _ = PAIRS[i]
    t, p, d, t_g = src.tp, src.pp, src.dp, dst.tp
    d_g = p * t // t_g
    split = _split_bytes()
    rep = sum(Box.full(m.shape).numel * m.itemsize for m in metas().values()) - split
    for rank in src.ranks:
        got = results[i][rank]["stats"]["bytes_received"]
        if src.fsdp:
            assert got * t_g * t * d == split * t * d + rep * t_g * t * d - (split * t_g + rep * t * t_g)
        else:
            assert got * t * p == (d_g - 1) * split


def test_ranks_outside_both_layouts_do_nothing(results):
    i = IDS.index("megatron(dp=2,tp=2,pp=1)->tp2 hybridflow")
    for rank in range(4, 8):
        s = results[i][rank]["stats"]
        assert results[i][rank]["calls"] == 0 and s["bytes_sent"] == s["bytes_received"] == 0


def test_both_send_paths_ran(results):
    """Some bytes went zero-copy from the shards and some were packed (row-parallel column blocks)."""
    stats = [res["stats"] for pair in results for res in pair]
    assert sum(s["bytes_sent_zero_copy"] for s in stats) > 0
    assert sum(s["bytes_sent"] - s["bytes_sent_zero_copy"] for s in stats) > 0


def test_shard_assembler_emits_each_parameter_once_complete():
    """Pieces in any order and any bucketing come out as one whole tensor per parameter."""
    from rlframe.resharding.executor import ShardAssembler
    from rlframe.resharding.planner import split_box

    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(6, 5, generator=g), "b": torch.randn(4, generator=g)}
    boxes = {"a": Box((2, 0), (4, 5)), "b": Box.full((4,))}
    pieces = [("a", b, full["a"][b.slices()]) for b in split_box(boxes["a"], 3)] + [("b", boxes["b"], full["b"])]
    order = torch.randperm(len(pieces), generator=g).tolist()
    out = []
    asm = ShardAssembler(boxes, out.extend)
    for i in range(0, len(order), 2):
        asm([pieces[j] for j in order[i:i + 2]])
    assert sorted(n for n, _, _ in out) == ["a", "b"] and asm.pending == []
    for name, box, t in out:
        assert box == boxes[name] and torch.equal(t, full[name][box.slices()])
    whole_b = next(t for n, _, t in out if n == "b")
    assert whole_b.data_ptr() == full["b"].data_ptr()  # a whole piece passes through without a copy


def test_delta_sync_equals_full_sync_and_sends_only_changes(spawned):
    """Delta syncs (delta.py) leave every rank exactly what a full sync does, sync after sync; with 1%
    of the elements changed they send a small part of the bytes, with none changed nothing, with half
    changed they fall back to dense messages, and every full_every-th sync is dense."""
    syncs = list(zip(*[r["delta"] for r in spawned]))  # per sync: every rank's result
    for i, ranks in enumerate(syncs):
        assert all(r["exact"] for r in ranks), i
    total = [(sum(r["sent"] for r in ranks), sum(r["full"] for r in ranks)) for ranks in syncs]
    first, one_pct, none, half, full_again, after_full = total
    assert after_full[0] < 0.1 * after_full[1]
    assert first[0] == first[1] and full_again[0] == full_again[1]  # dense: the first and the 4th after it
    assert all(r["sparse"] == 0 for r in syncs[0] + syncs[4])
    assert one_pct[0] < 0.1 * one_pct[1] and none[0] == 0
    assert 0.9 * half[1] <= half[0] <= half[1]  # mostly dense (cheaper), never more than dense
    assert all(sent <= full for sent, full in total)
    changed = [r["changed"] for r in syncs[1] if r["messages"]]
    assert changed and all(0.003 < c < 0.03 for c in changed), changed


def test_delta_refuses_a_sparse_update_without_a_previous_copy():
    from rlframe.resharding.delta import DeltaState

    sender, receiver = DeltaState(full_every=100), DeltaState(full_every=100)
    msg = torch.arange(64, dtype=torch.float32).view(torch.uint8)
    for state in (sender, receiver):
        state.begin_sync()
    head, payload = sender.encode("k", msg, 4)
    out = torch.empty_like(msg)
    receiver.decode("k", head, payload, out, 4)
    assert torch.equal(out, msg)
    sender.begin_sync()
    changed = msg.clone()
    changed.view(torch.float32)[3] = -1.0
    head, payload = sender.encode("k", changed, 4)
    assert int(head[0]) == 1 and payload.numel() == 8 + 4  # one index (padded to 8 bytes), one value
    with pytest.raises(ValueError, match="no previous copy"):
        DeltaState().decode("k", head, payload, out, 4)
    receiver.decode("k", head, payload, out, 4)
    assert torch.equal(out, changed)
