"""Micro-batch planning: fixed size, token budget, order restored."""

import pytest
import torch

from rlframe.workers.engines.micro_batch import plan_micro_batches, restore_order, split_indices
from tests.workers.engines.reference import make_batch


def test_split_by_size_and_by_token_budget():
    assert split_indices([3, 3, 3, 3, 3], micro_batch_size=2, max_tokens=None) == [[0, 1], [2, 3], [4]]
    assert split_indices([3, 3], micro_batch_size=None, max_tokens=None) == [[0, 1]]
    tokens = [9, 2, 7, 4, 1, 6]
    groups = split_indices(tokens, micro_batch_size=None, max_tokens=10)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(sum(tokens[i] for i in g) <= 10 for g in groups)
    assert len(groups) == 3  # 29 tokens, budget 10


def test_budget_smaller_than_a_sample_is_a_clear_error():
    with pytest.raises(ValueError, match="9 valid tokens, more than max_tokens_per_micro_batch=8"):
        split_indices([9, 2], micro_batch_size=None, max_tokens=8)


def test_restore_order_after_token_budget_split():
    b = make_batch(batch_size=8)
    mbs = plan_micro_batches(b, micro_batch_size=None, max_tokens=16, dp_group=None)
    assert len(mbs) > 1
    assert all(int(mb.data["attention_mask"].sum()) <= 16 for mb in mbs)
    per_mb = [mb.data["input_ids"] for mb in mbs]
    assert torch.equal(restore_order(per_mb, mbs), b["input_ids"])


def test_given_list_is_used_as_is():
    b = make_batch(batch_size=4)
    halves = [{k: v[:2] for k, v in b.items()}, {k: v[2:] for k, v in b.items()}]
    mbs = plan_micro_batches(halves, micro_batch_size=1, max_tokens=None, dp_group=None)
    assert [mb.size for mb in mbs] == [2, 2]
    with pytest.raises(ValueError, match="empty list"):
        plan_micro_batches([], micro_batch_size=None, max_tokens=None, dp_group=None)


def test_dataproto_batches_plan_like_dicts():
    from rlframe.protocol import DataProto

    b = make_batch(batch_size=6)
    proto = DataProto.from_dict(tensors=b)
    from_proto = plan_micro_batches(proto, micro_batch_size=4, max_tokens=None, dp_group=None)
    from_dict = plan_micro_batches(b, micro_batch_size=4, max_tokens=None, dp_group=None)
    assert [mb.size for mb in from_proto] == [mb.size for mb in from_dict] == [4, 2]
    for x, y in zip(from_proto, from_dict):
        assert x.data.keys() == y.data.keys()
        assert all(torch.equal(x.data[k], y.data[k]) for k in x.data)
