"""Small random HF checkpoints (Qwen2 with qkv bias, Llama with head_dim != hidden/heads) whose
shapes split over tp 1/2/4 and pp 1/2, for the megatron engine's tests."""

from __future__ import annotations

import torch


def build_hf_model(path: str, family: str, *, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
    if family == "qwen2":
        cfg = Qwen2Config(**common)
    elif family == "llama":
        cfg = LlamaConfig(**common, head_dim=16)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1 so a swapped norm would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def build_hf_critic(path: str, family: str, *, seed: int = 1) -> str:
    """The same architecture as a critic checkpoint (token classification, num_labels=1): the value
    head `score` comes from the file, so every engine starts from the same head."""
    from transformers import AutoModelForTokenClassification

    lm_path = build_hf_model(path + "-lm", family, seed=seed)
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_pretrained(lm_path, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.2)
        model.score.bias.fill_(0.1)
    model.save_pretrained(path)
    return path
