"""Packing valid tokens into rows: round trip, block-diagonal attention, compute saved."""

import pytest
import torch

from rlframe.workers.engines.packing import first_fit_decreasing, pack_inputs, padded_inputs, response_slice
from tests.workers.engines.reference import make_batch


def test_first_fit_decreasing_respects_capacity_and_keeps_every_item():
    sizes = [7, 3, 5, 2, 2, 8, 1]
    bins = first_fit_decreasing(sizes, 8)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 4  # 28 tokens need at least 4 bins of 8


def test_pack_round_trip_and_labels():
    b = make_batch(batch_size=8)
    packed = pack_inputs(b["input_ids"], b["attention_mask"], b["position_ids"])
    mask = b["attention_mask"].bool()
    assert packed.tokens_valid == int(mask.sum())
    assert packed.tokens_valid <= packed.tokens_computed < b["input_ids"].numel()
    assert packed.input_ids.shape[1] == int(mask.sum(1).max())
    # unpack(pack(x)) == x on valid positions, 0 elsewhere
    back = packed.unpack(packed.input_ids.float())
    assert torch.equal(back, (b["input_ids"] * mask).float())
    # each packed position carries the token that follows it in the original row
    labels = packed.unpack(packed.labels.float())
    t = b["input_ids"].shape[1]
    inner = mask[:, : t - 1] & mask[:, 1:]
    assert torch.equal(labels[:, : t - 1][inner], b["input_ids"][:, 1:][inner].float())
    # position ids restart at 0 for every packed sequence
    assert int((packed.position_ids == 0).sum()) >= b["input_ids"].shape[0]


def test_packed_forward_equals_padded_forward():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    b = make_batch(batch_size=8)
    outs = []
    for inputs in (padded_inputs(b["input_ids"], b["attention_mask"], b["position_ids"]),
                   pack_inputs(b["input_ids"], b["attention_mask"], b["position_ids"])):
        with torch.no_grad():
            logits = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                           position_ids=inputs.position_ids, use_cache=False).logits
        lp = torch.log_softmax(logits, -1).gather(-1, inputs.labels.unsqueeze(-1)).squeeze(-1)
        outs.append(response_slice(inputs.unpack(lp), b["responses"].shape[1]))
    m = b["response_mask"].bool()
    assert torch.allclose(outs[0][m], outs[1][m], atol=1e-5)


def test_padding_inside_a_row_is_rejected():
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]])
    with pytest.raises(ValueError, match=r"rows \[0\].*padding between valid tokens"):
        pack_inputs(ids, mask, mask.cumsum(1) - 1)
