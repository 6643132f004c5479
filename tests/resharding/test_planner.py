"""Planner (no processes): exact coverage, minimal bytes, load spreading, bucket bounds."""

import pytest
import torch

from rlframe.resharding.box import Box
from rlframe.resharding.layout import Layout, hf_tp_split_dim
from rlframe.resharding.planner import cached_plan, make_buckets, merge_boxes, param_metas, plan_reshard, split_box
from tests.resharding.pairs import DIMS, layout_pairs, metas, vllm_like_box

PAIRS = layout_pairs()


def minimum_bytes(src: Layout, dst: Layout, rank: int) -> int:
    """Reference: bytes of the destination boxes minus what the rank already holds in the source layout."""
    total = 0
    for name, m in metas().items():
        need = dst.box(name, m.shape, rank, num_layers=DIMS.num_layers)
        if need is None:
            continue
        held = src.box(name, m.shape, rank, num_layers=DIMS.num_layers)
        overlap = held.intersect(need) if held is not None else None
        total += (need.numel - (overlap.numel if overlap else 0)) * m.itemsize
    return total


@pytest.mark.parametrize("tag,src,dst,hybrid", PAIRS, ids=[p[0] for p in PAIRS])
def test_plan_covers_each_destination_box_exactly_once_from_holders(tag, src, dst, hybrid):
    plan = plan_reshard(metas(), src=src, dst=dst, num_layers=DIMS.num_layers)
    counts = {k: torch.zeros(b.sizes, dtype=torch.int32) for k, b in plan.dst_boxes.items()}
    for t in plan.transfers:
        assert plan.src_boxes[(t.name, t.src)].contains(t.box), t
        need = plan.dst_boxes[(t.name, t.dst)]
        counts[(t.name, t.dst)][t.box.relative_to(need).slices()] += 1
    for k, c in counts.items():
        assert bool((c == 1).all()), (tag, k)
    for r in plan.ranks:
        assert plan.bytes_received(r) == minimum_bytes(src, dst, r), (tag, r)
    assert sum(map(plan.bytes_sent, plan.ranks)) == sum(map(plan.bytes_received, plan.ranks))


def test_hybridflow_receives_table2_amount():
    """Megatron (p=1, t=4, d=2) -> (t_g=2): each rank receives (d_g - 1)/(t*p) of the TP-split bytes."""
    from rlframe.resharding.layout import hybridflow_generation_layout

    src = Layout(tp=4, dp=2)
    plan = plan_reshard(metas(), src=src, dst=hybridflow_generation_layout(src, tp=2))
    split = sum(Box.full(m.shape).numel * m.itemsize for n, m in metas().items() if hf_tp_split_dim(n) is not None)
    d_g, t, p = 2, 4, 1
    for r in range(8):
        assert plan.bytes_received(r) * t * p == (d_g - 1) * split


def test_replicas_share_the_sending():
    """dp=4 Megatron replicas -> split placement on 4 other ranks: all four sources send similar amounts."""
    src, dst = Layout(dp=4), Layout(tp=4, ranks=(4, 5, 6, 7))
    plan = plan_reshard(metas(), src=src, dst=dst)
    sent = [plan.bytes_sent(r) for r in range(4)]
    biggest = max(m.shape[0] * m.shape[-1] * m.itemsize for m in metas().values())
    assert min(sent) > 0 and max(sent) - min(sent) <= biggest, sent


def test_split_and_merge_boxes():
    box = Box((2, 3, 0), (5, 4, 6))
    for cap in (1, 5, 6, 7, 24, 25, 1000):
        parts = split_box(box, cap)
        assert all(p.numel <= cap for p in parts)
        cover = torch.zeros(7, 7, 6, dtype=torch.int32)
        for p in parts:
            cover[p.slices()] += 1
        assert bool((cover[box.slices()] == 1).all()) and int(cover.sum()) == box.numel
        assert merge_boxes(parts) == [box]


@pytest.mark.parametrize("bucket", [64, 300, 4096])
def test_buckets_bound_bytes_per_rank_and_keep_every_byte(bucket):
    src, dst = Layout(tp=2, dp=2, fsdp=True), Layout(tp=4)
    plan = plan_reshard(metas(), src=src, dst=dst)
    buckets = make_buckets(plan, bucket_bytes=bucket)
    for b in buckets:
        used = {}
        for t in b:
            if not t.local:
                n = -(-t.box.numel * plan.params[t.name].itemsize // 16) * 16
                used[t.src] = used.get(t.src, 0) + n
                used[t.dst] = used.get(t.dst, 0) + n
        assert max(used.values(), default=0) <= bucket
    flat = [t for b in buckets for t in b]
    for r in plan.ranks:
        assert sum(t.box.numel * plan.params[t.name].itemsize for t in flat if t.dst == r and not t.local) \
            == plan.bytes_received(r)
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_buckets(plan, bucket_bytes=8)


def test_cached_plan_is_reused_and_equals_a_fresh_plan():
    src, dst = Layout(tp=2, dp=2, fsdp=True), Layout(tp=4)
    a = cached_plan(metas(), src=src, dst=dst)
    assert cached_plan(metas(), src=Layout(tp=2, dp=2, fsdp=True), dst=Layout(tp=4)) is a
    assert a.transfers == plan_reshard(metas(), src=src, dst=dst).transfers
    assert cached_plan(metas(), src=src, dst=Layout(tp=2, dp=2)) is not a


def test_param_metas_from_tensors():
    got = param_metas({"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5, device="meta")})
    assert got["w"].shape == (3, 4) and got["w"].itemsize == 2 and got["b"].itemsize == 4


def test_summary_lists_every_rank_with_its_bytes():
    src = Layout(tp=4)
    from rlframe.resharding.layout import hybridflow_generation_layout

    plan = plan_reshard(metas(), src=src, dst=hybridflow_generation_layout(src, tp=2))
    text = plan.summary()
    assert "pp=1 tp=4 dp=1" in text and len(text.splitlines()) == 3 + 4
    assert f"| 2 | {plan.bytes_received(2) / 1e6:.2f} |" in text


def test_custom_destination_rule_vllm_vocab_padding_and_kv_replication():
    """dst_box overrides the split rule: exact coverage, empty needs skipped, replicated kv heads sent once each."""
    src, dst = Layout(tp=2, dp=2, fsdp=True), Layout(tp=4)
    plan = plan_reshard(metas(), src=src, dst=dst, dst_box=vllm_like_box)
    assert ("lm_head.weight", 3) not in plan.dst_boxes  # padded vocabulary: nothing left for rank 3
    assert plan.dst_boxes[("model.layers.0.self_attn.k_proj.weight", 1)] == Box((0, 0), (4, 24))
    counts = {k: torch.zeros(b.sizes, dtype=torch.int32) for k, b in plan.dst_boxes.items()}
    for t in plan.transfers:
        counts[(t.name, t.dst)][t.box.relative_to(plan.dst_boxes[(t.name, t.dst)]).slices()] += 1
    assert all(bool((c == 1).all()) for c in counts.values())
    for r in range(4):
        want = 0
        for (n, rr), need in plan.dst_boxes.items():
            held = src.box(n, metas()[n].shape, r)
            ov = held.intersect(need) if rr == r and held is not None else None
            want += (need.numel - (ov.numel if ov else 0)) * metas()[n].itemsize if rr == r else 0
        assert plan.bytes_received(r) == want


def test_hybridflow_transfers_stay_inside_micro_dp_groups():
    """Megatron (t=4, d=2) -> t_g=2: ranks {2k, 2k+1} form micro-DP groups and only exchange among themselves."""
    from rlframe.resharding.layout import hybridflow_generation_layout

    src = Layout(tp=4, dp=2)
    plan = plan_reshard(metas(), src=src, dst=hybridflow_generation_layout(src, tp=2))
    remote = [t for t in plan.transfers if not t.local]
    assert remote and all(t.src // 2 == t.dst // 2 for t in remote)
