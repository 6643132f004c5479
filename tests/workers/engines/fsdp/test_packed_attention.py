"""Packed micro-batches of several rows give the unpacked logits under every attention implementation
the fsdp engine may pick: sdpa, eager, CPU_BF16_ATTENTION, and flash attention 2/3.

Flash attention cannot run on CPU, so the flash tests run transformers' own dispatch
(`flash_attention_forward` -> `_flash_attention_forward`, which chooses between the dense, the
unpadding and the variable-length kernels) with pure-torch kernels in place of flash-attn's: the
kernels are loaded through transformers' lazy import (`_lazy_imports`), the one place it picks them.
The variable-length kernel is exact attention, causal within each cu_seqlens segment, so sequences
that are not kept apart show in the logits. A `gpu` test runs the real flash_attention_2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlframe.workers.engines.fsdp.modeling import CPU_BF16_ATTENTION, cpu_attention, run_model
from rlframe.workers.engines.packing import pack_inputs, padded_inputs
from tests.workers.engines.reference import make_batch

FLASH = ("flash_attention_2", "flash_attention_3")


def _attend(q, k, v, *, causal, scale):
    """(S, H, D) queries against (S, Hkv, D) keys and values (grouped-query heads)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=causal, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def torch_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_func on (B, S, H, D)."""
    assert dropout_p == 0.0
    return torch.stack([_attend(q[i], k[i], v[i], causal=causal, scale=softmax_scale) for i in range(q.shape[0])])


def torch_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                 softmax_scale=None, causal=False):
    """flash_attn_varlen_func on (total, H, D): each segment of cu_seqlens attends only within itself."""
    assert dropout_p == 0.0 and torch.equal(cu_seqlens_q, cu_seqlens_k), "self-attention segments"
    assert cu_seqlens_q.dtype == torch.int32 and int(cu_seqlens_q[-1]) == q.shape[0], "segments cover every token"
    bounds = cu_seqlens_q.tolist()
    longest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    assert max_seqlen_q >= longest and max_seqlen_k >= longest, "flash-attn sizes its grid by max_seqlen"
    out = torch.empty_like(q)
    for s, e in zip(bounds[:-1], bounds[1:]):
        out[s:e] = _attend(q[s:e], k[s:e], v[s:e], causal=causal, scale=softmax_scale)
    torch_flash_attn_varlen_func.segments.append(len(bounds) - 1)
    return out


@pytest.fixture
def torch_flash(monkeypatch):
    """transformers' flash attention path, running the pure-torch kernels above."""
    import transformers.modeling_flash_attention_utils as fa

    def lazy_imports(implementation, *args, **kwargs):
        return torch_flash_attn_func, torch_flash_attn_varlen_func, None, fa._pad_input, fa._unpad_input

    monkeypatch.setattr(fa, "_lazy_imports", lazy_imports)
    for cached in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                   "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn"):
        monkeypatch.setattr(fa, cached, None)  # load afresh now, and give the real ones back afterwards
    torch_flash_attn_varlen_func.segments = []
    return torch_flash_attn_varlen_func.segments


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2ForCausalLM

    from rlframe.data.tiny_model import PRESETS, make_config
    from rlframe.data.tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    return Qwen2ForCausalLM(make_config(PRESETS["test"], build_char_tokenizer())).eval()


def _batch():
    """4 samples that pack into 3 rows, the last holding two sequences and three empty slots."""
    b = make_batch(batch_size=4, seed=1)
    packed = pack_inputs(b["input_ids"], b["attention_mask"], b["position_ids"])
    assert packed.input_ids.shape == (3, 11) and packed.position_ids[2, :8].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    return b, packed


def _logits(model, inputs, attn: str, **call) -> torch.Tensor:
    """(B, T, V) logits of `inputs` under implementation `attn` (zero where not computed)."""
    model.config._attn_implementation = attn
    with torch.no_grad():
        logits = (run_model(model, inputs) if not call else model(**call)).logits.float()
    if inputs.src_index is None:
        return logits
    b, t = inputs.batch_shape
    out = logits.new_zeros(b * t, logits.shape[-1])
    out[inputs.src_index] = logits.reshape(-1, logits.shape[-1])[inputs.dst_index]
    return out.view(b, t, -1)


@pytest.mark.parametrize("attn", ["sdpa", "eager", CPU_BF16_ATTENTION, *FLASH])
def test_packed_rows_give_the_unpacked_logits(model, torch_flash, attn):
    if attn == CPU_BF16_ATTENTION:
        assert cpu_attention("sdpa", compute_dtype=torch.bfloat16) == attn  # registers it
    b, packed = _batch()
    valid = b["attention_mask"].bool()
    reference = _logits(model, padded_inputs(b["input_ids"], b["attention_mask"], b["position_ids"]), "sdpa")
    got = _logits(model, packed, attn)
    assert torch.allclose(got[valid], reference[valid], atol=1e-5)
    if attn in FLASH:  # the variable-length kernel ran on the packer's segments: 4 sequences + 2 row tails
        assert torch_flash == [6] * model.config.num_hidden_layers


def test_flash_without_boundaries_attends_across_packed_sequences(model, torch_flash):
    """What the boundaries prevent (and proof that the kernels above see it): transformers infers
    segments from position ids for one row only, so several rows run the dense causal kernel."""
    b, packed = _batch()
    valid = b["attention_mask"].bool()
    reference = _logits(model, padded_inputs(b["input_ids"], b["attention_mask"], b["position_ids"]), "sdpa")
    plain = _logits(model, packed, "flash_attention_2", input_ids=packed.input_ids,
                    position_ids=packed.position_ids, use_cache=False)
    assert torch_flash == []  # dense kernel only
    assert (plain[valid] - reference[valid]).abs().max() > 0.1


def test_packed_boundaries_cover_each_sequence_and_row_tail():
    b, packed = _batch()
    rows, cap = packed.input_ids.shape
    kw = packed.varlen_kwargs()
    cu = kw["cu_seq_lens_q"]
    assert kw["cu_seq_lens_k"] is cu and cu.dtype == torch.int32
    assert kw["max_length_q"] == kw["max_length_k"] == cap == int(b["attention_mask"].sum(1).max())
    lengths = cu.diff()
    assert int(cu[0]) == 0 and int(cu[-1]) == rows * cap and bool((lengths > 0).all())
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths).view(rows, cap)
    for i in range(4):  # each sample is exactly one segment
        seg_of_sample = segment.view(-1)[packed.dst_index[packed.src_index // b["input_ids"].shape[1] == i]]
        assert seg_of_sample.unique().numel() == 1
        assert int((segment.view(-1) == seg_of_sample[0]).sum()) == int(b["attention_mask"][i].sum())
    assert padded_inputs(b["input_ids"], b["attention_mask"], b["position_ids"]).varlen_kwargs() == {}


@pytest.mark.gpu
def test_real_flash_attention_2_on_packed_rows(model):
    pytest.importorskip("flash_attn")
    import copy

    gpu = copy.deepcopy(model).to("cuda", torch.bfloat16)
    b, packed = _batch()
    b = {k: v.cuda() for k, v in b.items()}
    packed = pack_inputs(b["input_ids"], b["attention_mask"], b["position_ids"])
    valid = b["attention_mask"].bool()
    reference = _logits(gpu, padded_inputs(b["input_ids"], b["attention_mask"], b["position_ids"]), "sdpa")
    gpu.set_attn_implementation("flash_attention_2")
    got = _logits(gpu, packed, "flash_attention_2")
    plain = _logits(gpu, packed, "flash_attention_2", input_ids=packed.input_ids,
                    position_ids=packed.position_ids, use_cache=False)
    err, err_plain = ((x[valid] - reference[valid]).abs().max().item() for x in (got, plain))
    assert err < 3e-2 and err_plain > 10 * err, (err, err_plain)
