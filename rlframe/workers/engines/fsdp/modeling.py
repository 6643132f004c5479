"""The transformers model of a local HF directory, for the fsdp engine.

Heads:
- "lm": `AutoModelForCausalLM` (actor, reference).
- "value": `AutoModelForTokenClassification` with num_labels=1 (critic). Its `score` layer is a
  Linear(hidden, 1) on the last hidden state; the backbone (`model.*`) loads from a causal-LM
  checkpoint (the LM head is dropped, `score` is initialised from `seed`, identically on every
  rank: value_head.py). A critic exported with `export_hf` reloads as the same class, score included.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from rlframe.workers.engines.packing import ModelInputs


def check_model_dir(path: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(
            f"model_path {path!r} is not a HF model directory (no config.json); build one with "
            "rlframe.data.tiny_model.build_random_model or point to a saved checkpoint"
        )
    return p


def load_config(path: str):
    from transformers import AutoConfig

    check_model_dir(path)
    return AutoConfig.from_pretrained(path)


def resolve_attn_implementation(name: str, *, on_gpu: bool) -> str:
    """"auto" -> flash_attention_2 on GPU when flash-attn is installed, else sdpa (also on CPU).

    Every implementation keeps packed sequences apart: flash attention through the boundaries that
    `run_model` passes, the others through the mask transformers builds from the position ids.
    """
    import importlib.util

    have_flash = importlib.util.find_spec("flash_attn") is not None
    if name == "auto":
        return "flash_attention_2" if on_gpu and have_flash else "sdpa"
    if name == "flash_attention_2" and not (on_gpu and have_flash):
        raise ValueError(
            "attn_implementation='flash_attention_2' needs a GPU and the flash-attn package "
            f"(GPU: {on_gpu}, flash-attn installed: {have_flash}); use 'auto' to fall back to sdpa"
        )
    return name


# bf16 attention on CPU: PyTorch's CPU flash-attention kernel in bf16 is slower than in fp32 at every
# length measured here (forward + backward of (32, 8, L, 32): L=22 20 ms vs 2.3 ms in fp32, L=200
# 110 vs 61 ms), so under bf16 mixed precision on CPU the attention itself runs in fp32.
CPU_BF16_ATTENTION = "sdpa_fp32"


def _sdpa_in_fp32(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights


def cpu_attention(attn_implementation: str, *, compute_dtype: torch.dtype) -> str:
    """`attn_implementation` for a CPU model computing in `compute_dtype`: sdpa in bf16 becomes
    CPU_BF16_ATTENTION (sdpa in fp32, with sdpa's masks), registered with transformers here."""
    if attn_implementation != "sdpa" or compute_dtype != torch.bfloat16:
        return attn_implementation
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CPU_BF16_ATTENTION, _sdpa_in_fp32)
    AttentionMaskInterface.register(CPU_BF16_ATTENTION, sdpa_mask)
    return CPU_BF16_ATTENTION


def run_model(model, inputs: ModelInputs):
    """The HF model's forward on padded or packed `inputs`. Flash attention (any version) gets the
    packed sequences' boundaries as keywords: without them it would run plain causal attention
    over each row of several rows, across the sequences packed in it (packing.py)."""
    from transformers.utils.generic import is_flash_attention_requested

    varlen = inputs.varlen_kwargs() if is_flash_attention_requested(model.config) else {}
    return model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                 position_ids=inputs.position_ids, use_cache=False, **varlen)


def empty_model(path: str, *, head: str, attn_implementation: str = "sdpa"):
    """The model of `path`'s config with every parameter on the meta device (no storage) and its
    buffers (rotary frequencies, computed from the config) on CPU, in train mode with dropout off
    (so every layout agrees). Tied weights are tied. The engine shards it, then fills each rank's
    shards from the checkpoint (fsdp/sharded_load.py)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    config = load_config(path)
    _disable_dropout(config)
    kwargs = dict(dtype=torch.float32, attn_implementation=attn_implementation)
    with parameters_on_meta():
        if head == "lm":
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:
            config.num_labels = 1
            model = AutoModelForTokenClassification.from_config(config, **kwargs)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.config.use_cache = False
    model.train()
    return model


@contextmanager
def parameters_on_meta():
    """Within the block, every parameter a module registers lands on the meta device (so nothing
    is allocated or initialised for it); tensors that are not parameters stay where made."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _disable_dropout(config) -> None:
    for name in ("attention_dropout", "hidden_dropout", "classifier_dropout"):
        if getattr(config, name, None):
            setattr(config, name, 0.0)


def copy_tokenizer_files(src: str, dst: str) -> None:
    """Copy the tokenizer of the source model dir next to an exported checkpoint."""
    import shutil

    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def save_full_model(full_state: dict[str, torch.Tensor], *, hf_config, head: str, out_dir: str) -> None:
    """Write `full_state` (HF names) as a checkpoint of the right class via `save_pretrained`."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForCausalLM if head == "lm" else AutoModelForTokenClassification
    with torch.device("meta"):
        model = cls.from_config(hf_config, dtype=torch.float32)
    model.load_state_dict(full_state, strict=True, assign=True)
    model.save_pretrained(out_dir)
