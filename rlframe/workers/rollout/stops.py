"""Which token ids end a response: the tokenizer's EOS and every id of the model's generation config.

Models such as Qwen2.5 and Llama 3 list several end ids in `generation_config.json`
(`eos_token_id: [<|im_end|>, <|endoftext|>]`, `[<|end_of_text|>, <|eot_id|>]`); the rollout engines
stop at any of them (vLLM and transformers read that file). Code that decides whether a response
ended (partial rollouts, the agent loop) must test the same set, or it continues a finished
response as if it had been cut off.
"""

from __future__ import annotations

import os


def end_of_sequence_ids(tokenizer, model_path: str | None = None) -> frozenset[int]:
    """The tokenizer's eos_token_id together with the generation config's eos_token_id (an int or a
    list) of `model_path` (default: the directory the tokenizer was loaded from, when it is one)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    path = model_path or getattr(tokenizer, "name_or_path", None)
    if path and os.path.isfile(os.path.join(path, "generation_config.json")):
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
    return frozenset(ids)
