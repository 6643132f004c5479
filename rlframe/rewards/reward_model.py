"""Pure helpers for reward-model scoring (prompt + response -> scalar) and ensembles.

The RewardModelWorker runs a stock sequence classifier (`AutoModelForSequenceClassification` with
num_labels=1: one pooled output per sequence) or a per-token head (`*ForTokenClassification`, a value
head) on prompt + response and reads the score at the sequence's last real token, as in InstructGPT's
reward model (Ouyang et al., 2022). These helpers do the bookkeeping (docs/reward_models.md):

- `build_rm_inputs`: left-padded prompts (B, P) + right-padded responses (B, R) -> one
  (B, P+R) batch with attention_mask and position_ids (contracts.md conventions);
- `retokenize_for_rm`: when the RM's tokenizer differs from the policy's, decode and re-encode
  (left-padded, truncated from the left so the response end is kept);
- `last_token_scores`: logits (B, T) or (B, T, 1) -> (B,) at the last position with mask 1;
- `pack_right`: real tokens to the right end of each row, so a pooled head reads the last one;
- `sequence_scores`: (B, 1) pooled outputs as they are, per-token outputs at the last real token;
- `same_tokenizer` / `rm_texts`: whether the policy's ids can be reused, and otherwise the text
  (the RM's chat template over the prompt's messages and the response) to re-tokenize;
- `check_reward_model_dir`: the config check of a reward.model_paths entry (files only);
- `ensemble_scores`: combine M reward models' (M, B) scores by mean or min (min is the
  conservative choice against reward hacking of one model, Coste et al., 2024).
"""

from __future__ import annotations

from rlframe.utils.masks import position_ids_from_mask

ENSEMBLE_MODES = ("mean", "min")


def build_rm_inputs(prompts, prompt_mask, responses, response_mask) -> dict:
    """Concatenate prompt and response ids for scoring.

    Args:
        prompts: (B, P) left-padded prompt ids; prompt_mask: (B, P) 1 on real prompt tokens.
        responses: (B, R) right-padded response ids; response_mask: (B, R) 1 on real response tokens.
    Returns:
        {"input_ids", "attention_mask", "position_ids"}: each (B, P+R) int64, position_ids =
        clamp(cumsum(attention_mask) - 1, min=0).
    """
    import torch

    same = prompts.shape == prompt_mask.shape and responses.shape == response_mask.shape
    if not same or prompts.shape[0] != responses.shape[0]:
        raise ValueError(
            f"shape mismatch: prompts {tuple(prompts.shape)}, prompt_mask {tuple(prompt_mask.shape)}, "
            f"responses {tuple(responses.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    input_ids = torch.cat([prompts, responses], dim=1).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = position_ids_from_mask(attention_mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def retokenize_for_rm(
    rm_tokenizer, prompts_text: list[str], responses_text: list[str], *, max_length: int
) -> dict:
    """Encode prompt+response texts with the reward model's own tokenizer, left-padded (B, T).

    Over-long sequences are truncated from the left: the end of the response is what the score
    is read from, so it must survive.
    """
    import torch

    if len(prompts_text) != len(responses_text):
        raise ValueError(f"{len(prompts_text)} prompts but {len(responses_text)} responses")
    seqs = [
        rm_tokenizer.encode(p + r, add_special_tokens=False)[-max_length:]
        for p, r in zip(prompts_text, responses_text)
    ]
    width = max((len(s) for s in seqs), default=0)
    pad = rm_tokenizer.pad_token_id if rm_tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
    position_ids = position_ids_from_mask(mask)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}


def last_token_scores(logits, attention_mask):
    """Score of each sequence at its last real token.

    Args:
        logits: (B, T) or (B, T, 1) per-token outputs of the reward model.
        attention_mask: (B, T) 1 on real tokens (any padding side).
    Returns:
        (B,) float32. A row with no real token raises ValueError (nothing to score).
    """
    import torch

    if logits.dim() == 3:
        if logits.shape[-1] != 1:
            raise ValueError(f"reward model must output one value per token; got logits {tuple(logits.shape)}")
        logits = logits.squeeze(-1)
    if logits.shape != attention_mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    valid = attention_mask > 0
    if not bool(valid.any(dim=1).all()):
        raise ValueError("a sequence has no real token (attention_mask all zero); it cannot be scored")
    positions = torch.arange(attention_mask.shape[1], device=logits.device).expand_as(attention_mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=1).values
    return logits.gather(1, last.unsqueeze(1)).squeeze(1).float()


def ensemble_scores(scores, *, mode: str = "mean"):
    """Combine M models' scores (M, B) -> (B,) by `mean` or `min`."""
    import torch

    s = torch.as_tensor(scores, dtype=torch.float32)
    if s.dim() != 2 or s.shape[0] == 0:
        raise ValueError(f"ensemble needs scores of shape (num_models, B); got {tuple(s.shape)}")
    if mode == "mean":
        return s.mean(dim=0)
    if mode == "min":
        return s.min(dim=0).values
    raise ValueError(f"unknown reward-model ensemble mode {mode!r}; use one of {ENSEMBLE_MODES}")


def pack_right(inputs: dict) -> dict:
    """Move every row's real tokens (attention_mask 1) to the right end, in order, padding on the left.

    `build_rm_inputs` leaves padding on both sides (left-padded prompt, right-padded response); a stock
    pooled head (`*ForSequenceClassification`) reads the rightmost token that is not its pad id, which
    after packing is the last real token (the last column) of every row.
    """
    import torch

    mask = inputs["attention_mask"]
    order = torch.sort(mask, dim=1, stable=True).indices  # zeros first, ones after, each in order
    ids = inputs["input_ids"].gather(1, order)
    mask = mask.gather(1, order)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}


def sequence_scores(logits, attention_mask):
    """Scores (B,) from a reward model's output: a pooled head's (B, 1) as it is, per-token (B, T) or
    (B, T, 1) outputs at each row's last real token (`last_token_scores`)."""
    if logits.dim() == 2 and logits.shape[1] == 1 and attention_mask.shape[1] != 1:
        return logits[:, 0].float()
    return last_token_scores(logits, attention_mask)


def same_tokenizer(a, b) -> bool:
    """True when two tokenizers give the same ids to the same text and render chats alike: equal
    vocabularies (added tokens included) and equal chat templates. Then the policy's ids are reused."""
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


def rm_texts(rm_tokenizer, raw_prompts, prompt_texts: list[str], response_texts: list[str]) -> list[str]:
    """The text the reward model scores: the conversation (the prompt's messages, then the response as
    the assistant's turn) in the RM's chat template; without a template, or without messages, the
    prompt text followed by the response."""
    template = getattr(rm_tokenizer, "chat_template", None)
    out = []
    for i, response in enumerate(response_texts):
        messages = None if raw_prompts is None else raw_prompts[i]
        if template and messages is not None and len(messages):
            chat = [dict(m) for m in messages] + [{"role": "assistant", "content": response}]
            out.append(rm_tokenizer.apply_chat_template(chat, tokenize=False))
        else:
            out.append(prompt_texts[i] + response)
    return out


def check_reward_model_dir(key: str, path) -> str | None:
    """A problem (what, why, how to fix) with a reward model directory, or None. Reads files only:
    config.json must name a sequence classifier (or a token classifier: one value per token) with
    one label, and the directory must hold its tokenizer."""
    import json
    from pathlib import Path

    d = Path(path).expanduser()
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        return (f"{key}={str(path)!r} has no config.json (missing or not an HF model directory); give the "
                "save_pretrained directory of a sequence classifier (AutoModelForSequenceClassification, num_labels=1)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as err:
        return f"{key}={str(path)!r}: config.json is not JSON ({err}); re-save the model with save_pretrained"
    archs = cfg.get("architectures") or []
    if not any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in archs):
        return (f"{key}={str(path)!r} is not a sequence classifier (config.json architectures: {archs}): a reward "
                "model outputs one score per sequence; give a *ForSequenceClassification model with num_labels=1 "
                "(e.g. AutoModelForSequenceClassification.from_pretrained(base, num_labels=1), trained on "
                "preferences), or build the tiny one with python -m rlframe.data.tiny_rm")
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)
    if labels != 1:
        return (f"{key}={str(path)!r} has {labels} labels (config.json id2label/num_labels): a reward model "
                "outputs one value; give a model trained with num_labels=1")
    tok_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((d / f).is_file() for f in tok_files):
        return (f"{key}={str(path)!r} has no tokenizer (none of {', '.join(tok_files)}): the response is "
                "re-tokenized with the reward model's own tokenizer when it differs from the policy's; save the "
                "tokenizer the reward model was trained with into the directory (tokenizer.save_pretrained(path))")
    if cfg.get("pad_token_id") is None and any(a.endswith("ForSequenceClassification") for a in archs):
        tc = d / "tokenizer_config.json"
        has_pad = tc.is_file() and json.loads(tc.read_text()).get("pad_token") is not None
        if not has_pad:
            return (f"{key}={str(path)!r} has no pad token (config.json pad_token_id and the tokenizer's "
                    "pad_token are unset): its pooled head finds each sequence's last token by the pad id; set "
                    "config.pad_token_id (e.g. to the eos id) and save the model again")
    return None
