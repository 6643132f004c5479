"""The dry run's activation formulas against what autograd really keeps, on tiny models.

Each case runs a forward (and the engines' vocab-parallel log-softmax on the logits) under
`saved_tensors_hooks`, sums the bytes of the distinct storages saved for backward (parameters
left out), and compares with `activation_memory`: the per-layer part (the difference between
two depths) within 1%, the whole micro-batch within 5% (token ids, rotary tables and labels are
not counted by the formulas).
"""

from contextlib import contextmanager

import pytest
import torch

from rlframe.plan.activation_memory import head_bytes, layer_bytes, layer_input_bytes, micro_batch_bytes
from rlframe.resharding.formats import ModelDims
from rlframe.utils.ports import free_port

TOKENS = 96
SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6)


def saved_bytes(model, run) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while `run()` executes."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _log_probs(logits, ids):
    from rlframe.workers.engines.fsdp.vocab_parallel import token_log_probs

    return token_log_probs(logits[:, :-1], ids[:, 1:], temperature=1.0, tp_rank=0)["log_probs"].sum()


def _hf_saved(family: str, layers: int, dtype, checkpointing: bool, device: str = "cpu") -> tuple[int, ModelDims]:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cfg = (Qwen2Config if family == "qwen2" else LlamaConfig)(num_hidden_layers=layers, **SHAPE)
    cfg._attn_implementation = "sdpa"  # the engine's choice without flash-attn (same saved tensors)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).train()
    if checkpointing:  # reentrant: the layer inputs are saved through autograd, so the hook sees them
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, SHAPE["vocab_size"], (1, TOKENS), device=device)
    dims = ModelDims.from_hf_config(cfg)
    return saved_bytes(model, lambda: _log_probs(model(input_ids=ids).logits, ids)), dims


@pytest.mark.parametrize("family,dtype,checkpointing", [("llama", torch.bfloat16, False),
                                                       ("qwen2", torch.bfloat16, False),
                                                       ("llama", torch.float32, False),
                                                       ("qwen2", torch.bfloat16, True)])
def test_fsdp_formula_matches_saved_tensors(family, dtype, checkpointing):
    (one, dims), (three, _) = (_hf_saved(family, n, dtype, checkpointing) for n in (1, 3))
    b = dtype.itemsize
    kw = dict(modules="transformers", itemsize=b, tp=1, sequence_parallel=False)
    per_layer = layer_input_bytes(dims, **kw) if checkpointing else layer_bytes(dims, seq_len=TOKENS, **kw)
    assert (three - one) / 2 == pytest.approx(TOKENS * per_layer, rel=0.01)
    if not checkpointing:  # the head's backward extra is not saved: compare the saved part only
        saved, extra = head_bytes(dims, head="lm", **kw)
        total = micro_batch_bytes(dims, tokens=TOKENS, seq_len=TOKENS, layers=3, last_stage=True, head="lm",
                                  checkpointing=False, **kw) - TOKENS * extra
        assert three == pytest.approx(total, rel=0.05)
        assert TOKENS * saved > 0.3 * (three - 3 * TOKENS * per_layer)  # the logits dominate the rest


@contextmanager
def one_process_megatron():
    """megatron-core's parallel state over a one-process gloo group, torn down afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlframe.workers.engines.megatron.model import init_model_parallel

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        init_model_parallel(tp=1, pp=1, seed=0)
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _megatron_saved(dtypes):
    from megatron.core import parallel_state as ps
    from transformers import LlamaConfig

    from rlframe.workers.engines.megatron.inputs import causal_padding_mask
    from rlframe.workers.engines.megatron.model import build_model, transformer_config

    out = []
    for dtype, layers in ((d, n) for d in dtypes for n in (1, 3)):
        hf = LlamaConfig(num_hidden_layers=layers, **SHAPE)
        cfg = transformer_config(hf, tp=1, pp=1, sequence_parallel=False, params_dtype=dtype, cpu_init=True)
        model = build_model(hf, head="lm", config=cfg, pre_process=ps.is_pipeline_first_stage(),
                            post_process=ps.is_pipeline_last_stage(), device=torch.device("cpu"))
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        ids = torch.randint(0, SHAPE["vocab_size"], (1, TOKENS))
        mask = causal_padding_mask(torch.ones(1, TOKENS))
        out.append(saved_bytes(model, lambda: _log_probs(
            model(ids, torch.arange(TOKENS)[None], attention_mask=mask), ids)))
    return [tuple(out[i:i + 2]) for i in range(0, len(out), 2)]  # (1 layer, 3 layers) per dtype


def test_megatron_formula_matches_saved_tensors():
    pytest.importorskip("megatron.core")
    from transformers import LlamaConfig

    dtypes = (torch.bfloat16, torch.float32)
    with one_process_megatron():
        measured = _megatron_saved(dtypes)
    dims = ModelDims.from_hf_config(LlamaConfig(num_hidden_layers=3, **SHAPE))
    for dtype, (one, three) in zip(dtypes, measured):
        kw = dict(modules="mcore", itemsize=dtype.itemsize, tp=1, sequence_parallel=False)
        assert (three - one) / 2 == pytest.approx(TOKENS * layer_bytes(dims, seq_len=TOKENS, **kw), rel=0.01)
        extra = head_bytes(dims, head="lm", **kw)[1]
        total = micro_batch_bytes(dims, tokens=TOKENS, seq_len=TOKENS, layers=3, last_stage=True, head="lm",
                                  checkpointing=False, **kw) - TOKENS * extra
        assert three == pytest.approx(total, rel=0.05)


@pytest.mark.gpu
def test_fsdp_layer_formula_holds_for_cuda_kernels():
    """On a GPU sdpa picks flash or memory-efficient attention: the same tensors are kept."""
    (one, dims), (three, _) = (_hf_saved("qwen2", n, torch.bfloat16, False, device="cuda") for n in (1, 3))
    kw = dict(modules="transformers", itemsize=2, tp=1, sequence_parallel=False)
    assert (three - one) / 2 == pytest.approx(TOKENS * layer_bytes(dims, seq_len=TOKENS, **kw), rel=0.02)


def _ulysses_saved(rank, world, kv_heads):
    """{kv heads: (saved bytes at 1 layer, at 3 layers)} of this rank's half of one sequence under Ulysses."""
    return {kv: _ulysses_saved_at(kv) for kv in kv_heads}


def _ulysses_saved_at(kv_heads):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlframe.workers.engines.fsdp import ulysses
    from rlframe.workers.engines.fsdp.modeling import run_model
    from rlframe.workers.engines.packing import padded_inputs

    out = []
    for layers in (1, 3):
        cfg = Qwen2Config(num_hidden_layers=layers, **{**SHAPE, "num_key_value_heads": kv_heads})
        cfg._attn_implementation = ulysses.attention_implementation("sdpa")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).train()
        ids = torch.randint(0, SHAPE["vocab_size"], (1, TOKENS))
        inputs = padded_inputs(ids, torch.ones_like(ids), torch.arange(TOKENS)[None])
        local, _ = ulysses.split_inputs(inputs, group=dist.group.WORLD, pad_token_id=0)
        out.append(saved_bytes(model, lambda: _log_probs(run_model(model, local).logits, local.input_ids)))
    return out


def test_ulysses_layer_formula_matches_saved_tensors():
    """sp=2 ranks; kv heads 2 (split over sp) and 1 (fewer than sp: repeated to the query heads)."""
    from rlframe.utils.spawn import run_distributed

    saved = run_distributed(_ulysses_saved, world_size=2, args=((2, 1),), timeout_s=120)[0]
    for kv_heads, (one, three) in saved.items():
        dims = ModelDims.from_hf_config(ModelDims.config_namespace({**SHAPE, "num_hidden_layers": 1,
                                                                     "num_key_value_heads": kv_heads}))
        per_layer = layer_bytes(dims, modules="transformers", itemsize=4, tp=1, sequence_parallel=False, seq_len=TOKENS,
                                ulysses=2)
        assert (three - one) / 2 == pytest.approx(TOKENS // 2 * per_layer, rel=0.01), kv_heads
