"""Ulysses sequence parallelism in the fsdp engine against a single-process reference (fp32, 1e-5).

One 4-rank spawn runs every layout (dp, sp, tp) side by side on a ("rep", "dp", "sp", "tp") mesh:
sp alone on 2 and 4 ranks, sp with dp, sp with tp; packed and padded micro-batches; an actor (log-probs
at a non-default temperature, entropy) and a critic (values); a token budget that splits the batch
into several micro-batches. Each compares its forward outputs, one training step's loss, gradient
norm and new weights with plain transformers + AdamW on the whole batch, and its shards with the
boxes the resharding layout predicts (sp ranks hold the weights as dp ranks do). The same spawn
runs the attention wrapper alone under sdpa, eager and flash attention (below).
"""

from __future__ import annotations

import pytest
import torch

from rlframe.utils.spawn import run_distributed
from tests.workers.engines.reference import box_errors, compare_forward_and_step, dp_slice, make_batch, single_process

TOL = 1e-5
HP = dict(lr=1e-3, weight_decay=0.1, eps=1e-6, grad_clip=1.0)
TEMPERATURE = 0.7
# (dp, sp, tp, engine settings) on the "test" preset (4 attention heads, 2 key/value heads)
CASES = [
    (1, 2, 1, {}),
    (1, 2, 1, {"remove_padding": False}),
    (1, 4, 1, {"max_tokens_per_micro_batch": 12}),  # 2 kv heads do not split over 4: repeated
    (2, 2, 1, {"max_tokens_per_micro_batch": 10}),
    (1, 2, 2, {}),  # 1 kv head per tp rank: repeated
    (1, 2, 1, {"activation_checkpointing": True, "remove_padding": False}),
    (2, 2, 1, {"gather_once_per_step": False, "micro_batch_size": 2}),  # FSDP's ZeRO-3 schedule (the GPU default)
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from rlframe.data.tiny_model import build_random_model

    return str(build_random_model(tmp_path_factory.mktemp("ulysses") / "m", preset="test", seed=0))


def _engine(path, *, dp, sp, tp, world, head, **config):
    from torch.distributed.device_mesh import init_device_mesh

    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    mesh = init_device_mesh("cpu", (world // (dp * sp * tp), dp, sp, tp), mesh_dim_names=("rep", "dp", "sp", "tp"))
    cfg = TrainEngineConfig(model_path=path, head=head, dp=dp, sp=sp, tp=tp, **{**HP, **config})
    return get_train_engine("fsdp")(cfg, device_mesh=mesh["dp", "sp", "tp"])


def _check(path, head, case, world, batch, ref, errors, tag=""):
    dp, sp, tp, extra = case
    tag = tag or f"{head}/dp{dp}sp{sp}tp{tp}/{','.join(f'{k}={v}' for k, v in extra.items()) or 'packed'}"
    engine = _engine(path, dp=dp, sp=sp, tp=tp, world=world, head=head, **extra)
    mine, rows = dp_slice(batch, engine)
    errors[f"{tag}/shards"] = box_errors(engine, ref["init"])  # sp ranks hold the weights as dp ranks do
    compare_forward_and_step(engine, mine, rows, ref, errors, tag, head=head,
                             temperature=TEMPERATURE if head == "lm" else 1.0)


def _all_cases(rank, world, path):
    batch = make_batch()
    refs = {head: single_process(path, head, batch, temperature=TEMPERATURE, **HP) for head in ("lm", "value")}
    errors: dict[str, float] = {}
    for case in CASES:
        _check(path, "lm", case, world, batch, refs["lm"], errors)
    for case in (CASES[0], CASES[3]):
        _check(path, "value", case, world, batch, refs["value"], errors)
    # one sequence (rows of one sequence each: plain causal attention, no mask), columns not divisible by sp
    one = make_batch(batch_size=1, prompt_len=7, response_len=6)
    _check(path, "lm", (1, 2, 1, {}), world, one, single_process(path, "lm", one, temperature=TEMPERATURE, **HP), errors, tag="one_sequence")
    errors.update(_wrapped_attention())
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    try:  # heads that do not split over tp x sp fail before any model work
        get_train_engine("fsdp")(TrainEngineConfig(model_path=path, sp=8))
    except ValueError as e:
        errors["bad_heads_raised"] = 0.0 if "tp(1) x sp(8)" in str(e) else 1.0
    else:
        errors["bad_heads_raised"] = 1.0
    return errors


def test_ulysses_matches_single_process(model_path):
    results = run_distributed(_all_cases, world_size=4, args=(model_path,), timeout_s=400)
    worst: dict[str, float] = {}
    for errs in results:
        # the variable-length kernel ran, once per layer, on packed and on padded rows of both batches
        assert errs.pop("attention/flash_varlen_calls") == 2 * 2 * 2
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
    assert len([k for k in worst if k.endswith("/new_weights")]) == len(CASES) + 3, sorted(worst)
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"differences above {TOL}: {bad}"


# ---------------------------------------------------------------------------------------------
# the attention wrapper under every implementation the engine may pick, flash attention included:
# sdpa, eager and flash attention (transformers' dispatch over pure-torch kernels) behind the
# all-to-all over the 4 ranks (2 kv heads repeated), on packed rows (several sequences each) and
# padded rows, give the one-process logits
def _wrapped_attention():
    import transformers.modeling_flash_attention_utils as fa
    from transformers import Qwen2ForCausalLM

    from rlframe.data.tiny_model import PRESETS, make_config
    from rlframe.data.tokenizer import build_char_tokenizer
    from rlframe.workers.engines.fsdp import ulysses
    from rlframe.workers.engines.fsdp.modeling import run_model
    from rlframe.workers.engines.packing import pack_inputs, padded_inputs
    from tests.workers.engines.fsdp import test_packed_attention as kernels

    # transformers' flash path with pure-torch kernels (test_packed_attention.py explains how)
    asked = []

    def lazy_imports(implementation, *args, **kwargs):
        asked.append(implementation)  # the kernel is picked by this name: the wrapped one, never the wrapper's
        return (kernels.torch_flash_attn_func, kernels.torch_flash_attn_varlen_func, None, fa._pad_input,
                fa._unpad_input)

    fa._lazy_imports = lazy_imports
    kernels.torch_flash_attn_varlen_func.segments = []
    config = make_config(PRESETS["test"], build_char_tokenizer())
    models = {}
    for name, extra in (("plain", {}), ("sliding", {"use_sliding_window": True, "sliding_window": 3,
                                                    "layer_types": ["sliding_attention"] * 2})):
        torch.manual_seed(0)
        models[name] = Qwen2ForCausalLM(type(config)(**{**config.to_dict(), **extra})).eval()
    assert models["sliding"].config.layer_types == ["sliding_attention"] * 2
    batches = {"mixed": make_batch(batch_size=4, seed=1),  # several sequences per packed row, padding
               "one": make_batch(batch_size=1, prompt_len=7, response_len=6)}  # one sequence, no padding
    group = torch.distributed.group.WORLD
    errors = {}
    for model_name, model in models.items():
        for batch_name, b in batches.items():
            valid = b["attention_mask"].bool()
            args = (b["input_ids"], b["attention_mask"], b["position_ids"])
            model.config._attn_implementation = "sdpa"
            with torch.no_grad():
                reference = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                  position_ids=b["position_ids"], use_cache=False).logits
            # flash-attn applies a sliding window itself (the kernels above have none)
            for attn in ("sdpa", "eager") + (("flash_attention_2",) if model_name == "plain" else ()):
                model.config._attn_implementation = ulysses.attention_implementation(attn)
                for kind, inputs in (("packed", pack_inputs(*args)), ("padded", padded_inputs(*args))):
                    local, split = ulysses.split_inputs(inputs, group=group, pad_token_id=0)
                    with torch.no_grad():
                        logits = ulysses.gather_columns(run_model(model, local).logits, split)
                    got = logits
                    if inputs.src_index is not None:  # packed rows back to the (B, T) batch
                        bsz, t = inputs.batch_shape
                        got = logits.new_zeros(bsz * t, logits.shape[-1])
                        got[inputs.src_index] = logits.reshape(-1, logits.shape[-1])[inputs.dst_index]
                        got = got.view(bsz, t, -1)
                    key = f"attention/{model_name}/{batch_name}/{attn}/{kind}"
                    errors[key] = float((got[valid] - reference[valid]).abs().max())
    errors["attention/flash_varlen_calls"] = len(kernels.torch_flash_attn_varlen_func.segments)
    errors["attention/flash_kernel_names_wrong"] = float(any(n != "flash_attention_2" for n in asked) or not asked)
    return errors

