"""Which slice each vLLM TP rank reads, and assembling pieces into it."""

from __future__ import annotations

import pytest
import torch

from rlframe.resharding.box import Box
from rlframe.workers.rollout.base import as_buckets
from rlframe.workers.rollout.weight_sync import ShardAssembler, vllm_needed_boxes, vllm_tp_box

KW = dict(num_kv_heads=2, head_dim=32)


def test_tp_boxes_follow_vllm_splits():
    q, o, norm = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight", "model.norm.weight"
    assert vllm_tp_box(q, (128, 128), tp_rank=1, tp_size=2, **KW) == Box((64, 0), (64, 128))
    assert vllm_tp_box(o, (128, 128), tp_rank=1, tp_size=2, **KW) == Box((0, 64), (128, 64))
    assert vllm_tp_box("model.layers.0.self_attn.o_proj.bias", (128,), tp_rank=1, tp_size=2, **KW) == Box.full((128,))
    assert vllm_tp_box(norm, (128,), tp_rank=1, tp_size=2, **KW) == Box.full((128,))
    # vocabulary padded to 64 before splitting: 100 rows -> [0, 64) and [64, 100)
    assert vllm_tp_box("lm_head.weight", (100, 8), tp_rank=0, tp_size=2, **KW) == Box((0, 0), (64, 8))
    assert vllm_tp_box("model.embed_tokens.weight", (100, 8), tp_rank=1, tp_size=2, **KW) == Box((64, 0), (36, 8))
    # tp 4 > 2 kv heads: kv heads replicated, ranks 0,1 read head 0 and ranks 2,3 head 1
    k = "model.layers.0.self_attn.k_proj.weight"
    assert [vllm_tp_box(k, (64, 128), tp_rank=r, tp_size=4, **KW).offsets[0] for r in range(4)] == [0, 0, 32, 32]
    assert vllm_tp_box("model.layers.0.self_attn.v_proj.bias", (64,), tp_rank=3, tp_size=4, **KW) == Box((32,), (32,))


def test_tp_boxes_tile_each_parameter():
    shapes = {"model.layers.0.mlp.gate_proj.weight": (96, 16), "model.layers.0.mlp.down_proj.weight": (16, 96),
              "lm_head.weight": (200, 16)}
    for tp in (2, 4):
        for name, shape in shapes.items():
            boxes = [vllm_needed_boxes(shapes, tp_rank=r, tp_size=tp, **KW)[name] for r in range(tp)]
            assert sum(b.numel for b in boxes) == torch.Size(shape).numel()
            cover = torch.zeros(shape)
            for b in boxes:
                cover[b.slices()] += 1
            assert (cover == 1).all(), (name, tp)


def test_assembler_completes_params_from_split_pieces_and_ignores_other_slices():
    full = torch.arange(48.0).reshape(8, 6)
    need = Box((4, 0), (4, 6))
    asm = ShardAssembler(needed={"w": need}, full_shapes={"w": (8, 6)}, full_shape_buffers=True, fill=float("nan"))
    assert asm.add([("w", Box((0, 0), (5, 6)), full[:5])]) == []  # overlaps the needed box by one row
    assert asm.missing() == ["w"]
    (name, box, buf), = asm.add([("w", Box((5, 0), (3, 6)), full[5:])])
    assert name == "w" and box == need and buf.shape == (8, 6)
    assert torch.equal(buf[4:], full[4:]) and buf[:4].isnan().all()
    assert asm.stats.bytes_resident == 4 * 6 * 4 and asm.stats.num_params == 1
    asm.check_complete()


def test_assembler_local_buffers_and_missing_report():
    asm = ShardAssembler(needed={"a": Box((0,), (4,)), "b": Box((2,), (2,))}, full_shapes={"a": (4,), "b": (4,)},
                         full_shape_buffers=False)
    (_, _, b), = asm.add([("b", Box.full((4,)), torch.tensor([1.0, 2.0, 3.0, 4.0]))])
    assert torch.equal(b, torch.tensor([3.0, 4.0]))
    asm.add([("a", Box((0,), (2,)), torch.ones(2))])
    with pytest.raises(ValueError, match="1 parameters not fully received.*'a': '2/4'"):
        asm.check_complete()
    with pytest.raises(ValueError, match="does not have"):
        asm.add([("zzz", Box.full((1,)), torch.ones(1))])
    with pytest.raises(ValueError, match="does not match its box"):
        asm.add([("a", Box((2,), (2,)), torch.ones(3))])


def test_as_buckets_accepts_state_dicts_pairs_and_buckets():
    sd = {"a": torch.ones(2), "b": torch.zeros(3)}
    from_dict = list(as_buckets(sd))
    assert [[(n, b) for n, b, _ in bucket] for bucket in from_dict] == [[("a", Box.full((2,)))], [("b", Box.full((3,)))]]
    assert len(list(as_buckets(iter(sd.items())))) == 2
    buckets = [[("a", Box.full((2,)), sd["a"]), ("b", Box.full((3,)), sd["b"])]]
    assert list(as_buckets(buckets)) == buckets
    with pytest.raises(ValueError, match="update_weights got an iterable of int"):
        list(as_buckets([1, 2]))


def test_stale_cpu_shm_segments_are_removed_and_live_ones_kept(tmp_path):
    """A segment nobody maps (left by a killed run) goes; one a live process maps stays."""
    import mmap

    from rlframe.workers.rollout.vllm_adapt import remove_stale_cpu_shm

    stale = tmp_path / "-tp:0-[0-1]-cpushm_0"
    live = tmp_path / "-tp:0-[0-1]-cpushm_1"
    for p in (stale, live):
        p.write_bytes(b"\0" * 4096)
    with live.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert remove_stale_cpu_shm(str(tmp_path)) == [stale.name]
    assert not stale.exists() and live.exists()


def test_receiving_side_peak_memory_is_measured():
    """A loader that keeps each 'layer' (two parameters) until it is complete, like vLLM's layer-wise
    reload: the assembler's peak held bytes is exactly one layer, and the process's peak resident
    memory during the update (measured, not computed) is at least that."""
    mib = 2**20
    shapes = {n: (4096, 4096) for n in ("l0.a", "l0.b", "l1.a")}  # 64 MiB each in fp32: fresh mmaps
    asm = ShardAssembler(needed={n: Box.full(s) for n, s in shapes.items()}, full_shapes=shapes,
                         full_shape_buffers=False)
    layer: list[torch.Tensor] = []
    for name in shapes:
        for half in (0, 1):
            piece = torch.full((2048, 4096), 1.0 + half)
            layer.extend(t for _, _, t in asm.add([(name, Box((2048 * half, 0), (2048, 4096)), piece)]))
        if name == "l0.b":
            layer.clear()  # layer 0 complete: the loader lets go of its tensors
    asm.check_complete()
    stats = asm.stats
    assert stats.peak_held_bytes == 2 * 64 * mib
    assert stats.peak_pending_bytes == 64 * mib
    if stats.peak_rss_extra_bytes >= 0:  # Linux
        assert stats.peak_rss_extra_bytes >= 2 * 64 * mib, stats
