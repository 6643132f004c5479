"""DataProto: every operation against hand-written expected rows, every error's text, pickling
(in-process out-of-band buffers and a real local Ray)."""

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rlframe.protocol import DataProto, receive_zero_copy

B = 6


def make(b: int = B, meta=None) -> DataProto:
    """Row i holds i in every field, so expected contents are easy to write down."""
    rows = torch.arange(b)
    return DataProto.from_dict(
        tensors={
            "input_ids": rows[:, None] * 10 + torch.arange(3),  # (B, 3) int64
            "mask": (rows[:, None] % 2 == 0).expand(b, 2).clone(),  # (B, 2) bool
            "logp": rows[:, None].float().expand(b, 4) / 8,  # (B, 4) float32 (strided view)
        },
        non_tensors={"uid": [f"u{i}" for i in range(b)], "gt": [[i, i] for i in range(b)]},
        meta_info={"temperature": 1.0} if meta is None else meta,
    )


def rows_of(dp: DataProto) -> list[int]:
    """The row ids a DataProto holds, checked consistent across all fields."""
    ids = (dp["input_ids"][:, 0] // 10).tolist()
    assert dp["uid"].tolist() == [f"u{i}" for i in ids]
    assert [g for g in dp["gt"]] == [[i, i] for i in ids]
    assert torch.equal(dp["logp"][:, 0], torch.tensor(ids, dtype=torch.float32) / 8)
    assert dp["mask"][:, 1].tolist() == [i % 2 == 0 for i in ids]
    return ids


# ----------------------------------------------------------------------------- construction
def test_from_dict_builds_object_arrays_and_len():
    dp = make()
    assert len(dp) == B
    assert isinstance(dp.batch, TensorDict) and list(dp.batch.batch_size) == [B]
    # Equal-length lists must stay one object per sample, not become a (B, 2) int array.
    assert dp["gt"].dtype == object and dp["gt"].shape == (B,)
    assert rows_of(dp) == list(range(B))
    assert len(DataProto()) == 0
    assert len(DataProto.from_dict(non_tensors={"uid": ["a", "b"]})) == 2


def test_constructor_accepts_unbatched_tensordict():
    td = TensorDict({"a": torch.zeros(3, 2), "b": torch.ones(3)}, batch_size=[])
    assert len(DataProto(batch=td)) == 3
    bad = TensorDict({"a": torch.zeros(3, 2), "b": torch.ones(4)}, batch_size=[])
    with pytest.raises(ValueError, match="tensor 'b' has batch size 4 but 'a' has 3"):
        DataProto(batch=bad)


def test_constructor_rejects_multi_dim_and_nested_tensordicts():
    with pytest.raises(ValueError, match=r"batch has batch_size \[3, 2\]; it must be \[B\]"):
        DataProto(batch=TensorDict({"a": torch.zeros(3, 2)}, batch_size=[3, 2]))
    nested = TensorDict({"a": torch.zeros(3), "sub": TensorDict({"b": torch.zeros(3)}, [3])}, [3])
    with pytest.raises(ValueError, match="batch field 'sub' is a TensorDict"):
        DataProto(batch=nested)
    with pytest.raises(ValueError, match="batch must be a tensordict.TensorDict, got dict"):
        DataProto(batch={"a": torch.zeros(3)})


def test_tensor_size_mismatch_names_keys_and_sizes():
    with pytest.raises(ValueError) as e:
        DataProto.from_dict(tensors={"input_ids": torch.zeros(8, 2), "responses": torch.zeros(6, 2)})
    assert str(e.value) == (
        "DataProto: tensor 'responses' has batch size 6 but 'input_ids' has 8; "
        "all fields must share the first dimension"
    )


def test_non_tensor_size_mismatch_names_keys_and_sizes():
    with pytest.raises(ValueError, match="non-tensor 'uid' has length 5 but tensor 'x' has 4"):
        DataProto.from_dict(tensors={"x": torch.zeros(4)}, non_tensors={"uid": list("abcde")})
    with pytest.raises(ValueError, match="non-tensor 'b' has length 3 but non-tensor 'a' has 2"):
        DataProto.from_dict(non_tensors={"a": [1, 2], "b": [1, 2, 3]})
    td = TensorDict({"x": torch.zeros(4)}, batch_size=[4])
    with pytest.raises(ValueError, match=r"non-tensor 'uid' must be a 1-D numpy array.*got list"):
        DataProto(batch=td, non_tensor_batch={"uid": ["a"] * 4})
    with pytest.raises(ValueError, match=r"non-tensor 'uid' has shape \(4, 2\)"):
        DataProto.from_dict(tensors={"x": torch.zeros(4)}, non_tensors={"uid": np.zeros((4, 2))})


def test_key_conflict_and_bad_values_are_errors():
    with pytest.raises(ValueError, match="key 'x' is both a tensor and a non-tensor"):
        DataProto.from_dict(tensors={"x": torch.zeros(2)}, non_tensors={"x": [1, 2]})
    with pytest.raises(ValueError, match="tensor 'x' is a scalar"):
        DataProto.from_dict(tensors={"x": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="tensor field 'x' is a list"):
        DataProto.from_dict(tensors={"x": [1, 2]})
    with pytest.raises(ValueError, match="non-tensor 'y' must be a list.*got str"):
        DataProto.from_dict(non_tensors={"y": "abc"})


def test_repr_lists_keys_shapes_dtypes():
    text = repr(make())
    assert "DataProto(len=6" in text
    assert "input_ids: (6, 3) int64" in text and "mask: (6, 2) bool" in text
    assert "uid: (6,) numpy object (non-tensor)" in text and "'temperature': 1.0" in text


# ------------------------------------------------------------------------------- indexing
@pytest.mark.parametrize(
    "idx, expected",
    [
        (2, [2]),
        (-1, [5]),
        (slice(1, 4), [1, 2, 3]),
        (slice(None, None, -2), [5, 3, 1]),
        ([4, 0, 4], [4, 0, 4]),
        (torch.tensor([3, 1]), [3, 1]),
        (np.array([True, False, False, True, False, True]), [0, 3, 5]),
        (torch.tensor([False] * 6), []),
        ([], []),
    ],
)
def test_index_returns_expected_rows(idx, expected):
    out = make()[idx]
    assert isinstance(out, DataProto) and len(out) == len(expected)
    assert rows_of(out) == expected
    assert out.meta_info == {"temperature": 1.0}


def test_index_errors():
    dp = make()
    with pytest.raises(IndexError, match="index 6 is out of range for batch size 6"):
        dp[6]
    with pytest.raises(IndexError, match="index -7 is out of range for batch size 6"):
        dp[[0, -7]]
    with pytest.raises(ValueError, match=r"bool mask has shape \(4,\) but the batch size is 6"):
        dp[torch.tensor([True, False, True, True])]
    with pytest.raises(KeyError, match="no field 'nope'"):
        dp["nope"]


# ------------------------------------------------------------------- select / pop / rename
def test_select_keeps_named_keys_and_shares_storage():
    dp = make()
    out = dp.select(batch_keys=["input_ids"], non_tensor_keys=["uid"], meta_info_keys=[])
    assert out.batch_keys == ["input_ids"] and out.non_tensor_keys == ["uid"] and out.meta_info == {}
    assert out["input_ids"].data_ptr() == dp["input_ids"].data_ptr()
    everything = dp.select()
    assert set(everything.batch_keys) == {"input_ids", "mask", "logp"} and everything.meta_info == dp.meta_info
    only_nt = dp.select(batch_keys=[], non_tensor_keys=["gt"])
    assert only_nt.batch is None and len(only_nt) == B
    assert len(dp.select(batch_keys=[], non_tensor_keys=[])) == B  # B survives an empty selection


def test_select_unknown_key_lists_available_keys():
    dp = make()
    with pytest.raises(KeyError, match=r"tensor key\(s\) \['foo'\] not found; available tensor keys: "
                                       r"\['input_ids', 'mask', 'logp'\]"):
        dp.select(batch_keys=["foo"])
    with pytest.raises(KeyError, match=r"non-tensor key\(s\) \['bar'\] not found.*\['uid', 'gt'\]"):
        dp.pop(non_tensor_keys=["bar"])
    with pytest.raises(KeyError, match=r"meta_info key\(s\) \['x'\] not found.*\['temperature'\]"):
        dp.select(meta_info_keys=["x"])


def test_pop_removes_from_self():
    dp = make()
    popped = dp.pop(batch_keys=["logp"], non_tensor_keys=["gt"], meta_info_keys=["temperature"])
    assert popped.batch_keys == ["logp"] and popped.non_tensor_keys == ["gt"]
    assert popped.meta_info == {"temperature": 1.0}
    assert set(dp.batch_keys) == {"input_ids", "mask"} and dp.non_tensor_keys == ["uid"]
    assert dp.meta_info == {} and len(dp) == B
    assert torch.equal(popped["logp"][:, 0], torch.arange(B).float() / 8)
    nothing = dp.pop()
    assert len(dp.batch_keys) == 2 and nothing.batch_keys == [] and nothing.non_tensor_keys == []


def test_rename():
    dp = make().rename({"logp": "old_log_probs", "uid": "group"})
    assert set(dp.batch_keys) == {"input_ids", "mask", "old_log_probs"}
    assert dp.non_tensor_keys == ["group", "gt"] and dp["group"][1] == "u1"
    with pytest.raises(ValueError, match=r"duplicate keys \['mask'\]"):
        make().rename({"logp": "mask"})
    with pytest.raises(KeyError, match=r"field key\(s\) \['zzz'\] not found"):
        make().rename({"zzz": "a"})


# ---------------------------------------------------------------------------------- union
def test_union_merges_fields_and_meta():
    dp = make()
    other = DataProto.from_dict(
        tensors={"input_ids": dp["input_ids"].clone(), "values": torch.full((B, 2), 7.0)},
        non_tensors={"uid": dp["uid"].copy(), "score": list(range(B))},
        meta_info={"temperature": 1.0, "n": 2},
    )
    out = dp.union(other)
    assert set(out.batch_keys) == {"input_ids", "mask", "logp", "values"}
    assert set(out.non_tensor_keys) == {"uid", "gt", "score"}
    assert out.meta_info == {"temperature": 1.0, "n": 2}
    assert torch.equal(out["values"], torch.full((B, 2), 7.0)) and out["score"].tolist() == list(range(B))
    assert rows_of(out) == list(range(B))


def test_union_conflicts_name_the_key():
    dp = make()
    t = DataProto.from_dict(tensors={"input_ids": dp["input_ids"] + 1})
    with pytest.raises(ValueError, match="tensor 'input_ids' differs between the two sides"):
        dp.union(t)
    nt = DataProto.from_dict(non_tensors={"uid": ["x"] * B})
    with pytest.raises(ValueError, match="non-tensor 'uid' differs"):
        dp.union(nt)
    meta = DataProto.from_dict(non_tensors={"z": [0] * B}, meta_info={"temperature": 0.5})
    with pytest.raises(ValueError, match=r"meta_info 'temperature' differs between parts \(1.0 vs 0.5\)"):
        dp.union(meta)
    with pytest.raises(ValueError, match=r"batch sizes differ \(6 vs 4\)"):
        dp.union(make(4))


# ---------------------------------------------------------------------- concat / chunk / split
def test_concat_of_chunks_is_identity():
    dp = make()
    for n in (1, 2, 3, 6):
        parts = dp.chunk(n)
        assert [rows_of(p) for p in parts] == [list(range(i, i + B // n)) for i in range(0, B, B // n)]
        assert DataProto.concat(parts).equals(dp)


def test_concat_errors_name_the_key():
    a, b = make(2), make(3, meta={"temperature": 0.7})
    with pytest.raises(ValueError, match=r"meta_info 'temperature' differs between parts \(1.0 vs 0.7\)"):
        DataProto.concat([a, b])
    with pytest.raises(ValueError, match=r"meta_info key\(s\) \['extra'\] are in some parts but not others"):
        DataProto.concat([a, make(2, meta={"temperature": 1.0, "extra": 1})])
    with pytest.raises(ValueError, match=r"part 1 has tensor keys \['input_ids', 'mask'\] but part 0 has"):
        DataProto.concat([a, make(2).select(batch_keys=["input_ids", "mask"])])
    with pytest.raises(ValueError, match="empty list"):
        DataProto.concat([])


def test_concat_gathers_per_part_meta_keys():
    a = make(2, meta={"temperature": 1.0, "gen_time_s": 0.5})
    b = make(3, meta={"temperature": 1.0, "gen_time_s": 0.7})
    with pytest.raises(ValueError, match=r"meta_info 'gen_time_s' differs.*gather_meta_keys"):
        DataProto.concat([a, b])
    out = DataProto.concat([a, b], gather_meta_keys=["gen_time_s", "absent"])
    assert out.meta_info == {"temperature": 1.0, "gen_time_s": [0.5, 0.7], "absent": [None, None]}
    assert rows_of(out) == [0, 1, 0, 1, 2]


def test_chunk_indivisible_suggests_padding():
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by 4; call .*pad_to_divisor\(4\)"):
        make().chunk(4)


def test_split_last_part_smaller():
    parts = make().split(4)
    assert [rows_of(p) for p in parts] == [[0, 1, 2, 3], [4, 5]]
    assert [rows_of(p) for p in make().split(10)] == [list(range(B))]


# ------------------------------------------------------------------------ repeat / reorder
def test_repeat_interleaved_and_tiled():
    dp = make(3)
    assert rows_of(dp.repeat(2)) == [0, 0, 1, 1, 2, 2]
    assert rows_of(dp.repeat(2, interleave=False)) == [0, 1, 2, 0, 1, 2]
    assert rows_of(dp.repeat(1)) == [0, 1, 2]
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        dp.repeat(0)


def test_reorder_is_in_place():
    dp = make()
    assert dp.reorder([5, 3, 1, 0, 2, 4]) is None
    assert rows_of(dp) == [5, 3, 1, 0, 2, 4]
    dp.reorder(torch.tensor([1, 0, 2, 3, 4, 5]))
    assert rows_of(dp) == [3, 5, 1, 0, 2, 4]
    with pytest.raises(ValueError, match="expected 6 int indices"):
        dp.reorder([0, 1])
    with pytest.raises(ValueError, match=r"not a permutation of range\(6\)"):
        dp.reorder([0, 0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"not a permutation of range\(6\)"):
        dp.reorder([0, 1, 2, 3, 4, 9])
    assert rows_of(dp) == [3, 5, 1, 0, 2, 4]  # a rejected reorder leaves the rows alone


# --------------------------------------------------------------------------------- padding
def test_pad_to_divisor_repeats_from_start_and_unpads():
    dp = make(5)
    padded, pad = dp.pad_to_divisor(4)
    assert pad == 3 and rows_of(padded) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert padded.unpad(pad).equals(dp)
    small, pad = make(2).pad_to_divisor(7)  # more padding than rows: wraps around
    assert pad == 5 and rows_of(small) == [0, 1, 0, 1, 0, 1, 0]
    same, pad = dp.pad_to_divisor(5)
    assert pad == 0 and same.equals(dp)
    chunks = padded.chunk(4)
    assert DataProto.concat(chunks).unpad(3).equals(dp)
    with pytest.raises(ValueError, match=r"pad_size must be an int in \[0, 5\], got 6"):
        dp.unpad(6)


# ------------------------------------------------------------------------- minibatches, to
def test_iter_minibatches_order_shuffle_and_epochs():
    dp = make()
    assert [rows_of(m) for m in dp.iter_minibatches(4)] == [[0, 1, 2, 3], [4, 5]]
    runs = [[rows_of(m) for m in dp.iter_minibatches(3, shuffle=True, seed=0, epochs=2)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 4  # reproducible; 2 epochs x 2 minibatches
    for epoch in (runs[0][:2], runs[0][2:]):
        assert sorted(epoch[0] + epoch[1]) == list(range(B))  # each epoch is a permutation
    assert runs[0][:2] != runs[0][2:]  # each epoch draws its own permutation (fixed seed)
    assert runs[0][:2] != [[0, 1, 2], [3, 4, 5]]
    assert list(dp.iter_minibatches(2, epochs=0)) == []
    with pytest.raises(ValueError, match="size must be a positive int, got 0"):
        next(dp.iter_minibatches(0))


def test_to_device_returns_new():
    dp = make()
    moved = dp.to("cpu")
    assert moved is not dp and moved.equals(dp) and moved.batch.device == torch.device("cpu")


# -------------------------------------------------------------------------------- pickling
def all_dtypes(b: int = 4) -> DataProto:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, 5, generator=g)
    return DataProto.from_dict(
        tensors={
            "f32": x, "f64": x.double(), "f16": x.half(), "bf16": x.bfloat16(),
            "i64": torch.arange(b * 3).reshape(b, 3), "i8": torch.arange(b, dtype=torch.int8) - 2,
            "u8": torch.arange(b, dtype=torch.uint8), "bool": x > 0,
            "strided": x.t().contiguous().t(), "empty": torch.zeros(b, 0),
            "f8": x.to(torch.float8_e4m3fn), "c64": torch.complex(x, -x),
        },
        non_tensors={"uid": [f"u{i}" for i in range(b)], "nums": np.arange(b, dtype=np.float32)},
        meta_info={"temperature": 0.7, "nested": {"a": [1, 2]}},
    )


def test_pickle_protocol5_is_out_of_band_and_exact():
    dp = all_dtypes()
    buffers = []
    data = pickle.dumps(dp, protocol=5, buffer_callback=buffers.append)
    # One buffer per tensor plus one for the numeric non-tensor array; the object array of
    # strings and the meta_info stay in the (small) pickle stream.
    assert len(buffers) == len(dp.batch_keys) + 1
    payload = sum(t.numel() * t.element_size() for t in dp.batch.values()) + dp["nums"].nbytes
    assert sum(memoryview(b).nbytes for b in buffers) == payload
    assert len(data) < 3000
    out = pickle.loads(data, buffers=buffers)
    assert out.equals(dp) and out["bf16"].dtype == torch.bfloat16 and out["bool"].dtype == torch.bool
    assert all(out[k].dtype == dp[k].dtype for k in dp.batch_keys)
    assert pickle.loads(pickle.dumps(dp)).equals(dp)  # default protocol, in-band
    for other in (DataProto.from_dict(non_tensors={"uid": ["a", "b"]}, meta_info={"k": 1}), DataProto()):
        back = pickle.loads(pickle.dumps(other, protocol=5))
        assert back.equals(other) and back.batch is None and back.meta_info == other.meta_info




def test_ray_put_get_and_actor_roundtrip_exact(ray_cluster):
    ray = ray_cluster  # the suite's shared local Ray (tests/conftest.py): started once per session
    dp = all_dtypes()
    got = ray.get(ray.put(dp))
    assert got.equals(dp)
    # Tensors built from Ray's read-only shared buffers must be private copies: writing one
    # must not change what a second reader of the same object sees.
    ref = ray.put(dp)
    first, second = ray.get(ref), ray.get(ref)
    first["i64"].add_(100)
    assert torch.equal(second["i64"], dp["i64"])
    assert first["f32"].data_ptr() != second["f32"].data_ptr()
    # Opt-in aliasing: both reads see the same shared-memory bytes, and concat copies them out.
    with receive_zero_copy():
        a, b = ray.get(ref), ray.get(ref)
        merged = DataProto.concat([a, b])
    assert a.equals(dp) and a["f32"].data_ptr() == b["f32"].data_ptr()
    assert merged.equals(DataProto.concat([dp, dp]))

    @ray.remote(num_cpus=0)
    class Echo:
        def scale(self, batch):
            torch.set_num_threads(1)
            batch = batch.union(DataProto.from_dict(tensors={"twice": batch["f32"] * 2}))
            return batch

    back = ray.get(Echo.remote().scale.remote(dp))
    assert back.select(batch_keys=dp.batch_keys).equals(dp)
    assert torch.equal(back["twice"], dp["f32"] * 2)
