import numpy as np
import pytest
import torch

from rlframe.data.dataloader import StatefulDataLoader, collate, to_dataproto
from rlframe.data.dataset import PromptDataset
from rlframe.data.synthetic import ArithmeticSpec, arithmetic_rows, write_parquet
from rlframe.data.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = build_char_tokenizer()
    rows = arithmetic_rows(num_train=50, num_test=0, spec=ArithmeticSpec(digits=2), seed=0)["train"]
    path = write_parquet(rows, tmp_path_factory.mktemp("d") / "train.parquet")
    return tok, PromptDataset(path, tokenizer=tok, max_prompt_length=8)


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert list(a[k]) == list(b[k]), k


def test_collate_left_pads_with_positions(setup):
    tok, ds = setup
    rows = [ds[i] for i in range(4)]
    b = collate(rows, [0, 1, 2, 3], pad_token_id=tok.pad_token_id)
    for i, r in enumerate(rows):
        n = len(r.prompt_ids)
        assert b["input_ids"][i, -n:].tolist() == r.prompt_ids
        assert b["attention_mask"][i].sum() == n and b["attention_mask"][i, -n:].all()
        assert b["position_ids"][i, -n:].tolist() == list(range(n))
    assert b["raw_prompt"].dtype == object and b["raw_prompt"][0] == rows[0].raw_prompt
    assert isinstance(b["extra_info"][0], dict)
    assert collate(rows, [0, 1, 2, 3], pad_token_id=0, pad_to=10)["input_ids"].shape == (4, 10)


def test_epochs_cover_the_data_and_depend_on_the_seed(setup):
    tok, ds = setup
    dl = StatefulDataLoader(ds, batch_size=16, seed=1, pad_token_id=tok.pad_token_id)
    assert len(dl) == 3
    epoch = [i for _ in range(3) for i in next(dl)["index"]]
    assert len(set(epoch)) == 48  # drop_last: 2 of 50 left out
    nxt = next(dl)  # a new epoch, a new order
    assert list(nxt["index"]) != epoch[:16]
    other = StatefulDataLoader(ds, batch_size=16, seed=2, pad_token_id=tok.pad_token_id)
    assert list(next(other)["index"]) != epoch[:16]


def test_save_restore_gives_identical_next_batches(setup):
    tok, ds = setup
    dl = StatefulDataLoader(ds, batch_size=16, seed=7, pad_token_id=tok.pad_token_id)
    for _ in range(4):  # into the second epoch
        next(dl)
    state = dl.state_dict()
    expected = [next(dl) for _ in range(5)]  # crosses another epoch boundary
    fresh = StatefulDataLoader(ds, batch_size=16, seed=123, pad_token_id=tok.pad_token_id)
    fresh.load_state_dict(state)
    for want in expected:
        _same(next(fresh), want)


def test_max_epochs_and_errors(setup):
    tok, ds = setup
    dl = StatefulDataLoader(ds, batch_size=20, seed=0, pad_token_id=0, drop_last=False, shuffle=False, max_epochs=1)
    sizes = [len(b["index"]) for b in dl]
    assert sizes == [20, 20, 10]
    with pytest.raises(ValueError, match="fewer than one batch"):
        StatefulDataLoader(ds, batch_size=64, pad_token_id=0)
    state = StatefulDataLoader(ds, batch_size=4, pad_token_id=0).state_dict()
    state["dataset_len"] = 3
    with pytest.raises(ValueError, match="same data files"):
        StatefulDataLoader(ds, batch_size=4, pad_token_id=0).load_state_dict(state)


def test_to_dataproto(setup):
    tok, ds = setup
    batch = next(StatefulDataLoader(ds, batch_size=8, seed=0, pad_token_id=tok.pad_token_id))
    proto = to_dataproto(batch, meta_info={"temperature": 1.0})
    assert len(proto) == 8
    assert torch.equal(proto.batch["input_ids"], batch["input_ids"])
    assert np.array_equal(proto.non_tensor_batch["data_source"], batch["data_source"])
    assert proto.meta_info["temperature"] == 1.0
