"""Small Qwen2-architecture models built from a seed, saved as local HF directories.

`build_random_model(out_dir, preset="demo", seed=0)` writes `config.json`, `model.safetensors`
and the preset's tokenizer (the character one, or the BPE one with a chat template for `agent`), loadable by `AutoModelForCausalLM.from_pretrained` and by vLLM.
Presets name shapes used across tests and benchmarks; `count_parameters(preset)` gives their
sizes. Weights are random (seeded); pre-training for the demo lives in `pretrain.py`, and the
pre-trained demo model ships in `presets/` (`shipped.py`); `python -m rlframe.data.rebuild
demo` rebuilds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int = 512
    tokenizer: str = "char"  # "char" (rlframe/data/tokenizer.py) or "bpe" (rlframe/data/bpe_tokenizer.py)


# head_dim = hidden_size / num_heads is 32 or 64 (sizes vLLM's CPU attention supports) in every preset
# but `test` (head_dim 16), which unit tests use with transformers only.
PRESETS: dict[str, ModelShape] = {
    "test": ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    "demo": ModelShape(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "12m": ModelShape(hidden_size=256, num_layers=12, num_heads=8, num_kv_heads=4, intermediate_size=1024),
    "50m": ModelShape(hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=4, intermediate_size=2048),
    "100m": ModelShape(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=3072),
    # Multi-turn tool use (docs/tiny_model.md, "The agent preset"): BPE tokenizer with a chat template.
    # Narrow (hidden 64) because its sequences are ~150 tokens: the pre-training stays near a minute.
    "agent": ModelShape(hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=2, intermediate_size=192,
                        tokenizer="bpe"),
}


def save_tokenizer(out_dir: str | Path, shape: ModelShape):
    """Write the preset's tokenizer into `out_dir`; returns it."""
    if shape.tokenizer == "bpe":
        from rlframe.data.bpe_tokenizer import save_bpe_tokenizer

        return save_bpe_tokenizer(out_dir)
    from rlframe.data.tokenizer import save_char_tokenizer

    return save_char_tokenizer(out_dir)


def make_config(shape: ModelShape, tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def build_random_model(out_dir: str | Path, *, preset: str = "demo", seed: int = 0) -> Path:
    """Write a seeded random-init Qwen2 model + the preset's tokenizer to `out_dir`; return the path."""
    import torch
    from transformers import Qwen2ForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(out, PRESETS[preset])
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(make_config(PRESETS[preset], tok)).to(torch.float32)
    model.save_pretrained(str(out))
    return out


def count_parameters(preset: str) -> int:
    """Number of parameters of a preset, computed on the meta device (no memory)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from rlframe.data.bpe_tokenizer import build_bpe_tokenizer
    from rlframe.data.tokenizer import build_char_tokenizer

    shape = PRESETS[preset]
    tok = build_bpe_tokenizer() if shape.tokenizer == "bpe" else build_char_tokenizer()
    with torch.device("meta"):
        model = Qwen2ForCausalLM(make_config(shape, tok))
    return sum(p.numel() for p in model.parameters())
