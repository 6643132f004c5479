"""Pure helpers for reward-model scoring (prompt + response -> scalar) and ensembles.

The RewardModelWorker runs a sequence-classification model (one output per token, e.g.
`AutoModelForSequenceClassification` with num_labels=1, or a value head) on `cat(prompt, response)`
and reads the output at the sequence's last real token, as in InstructGPT's reward model
(Ouyang et al., 2022). These helpers do the tensor bookkeeping:

- `build_rm_inputs`: left-padded prompts (B, P) + right-padded responses (B, R) -> one
  (B, P+R) batch with attention_mask and position_ids (contracts.md conventions);
- `retokenize_for_rm`: when the RM's tokenizer differs from the policy's, decode and re-encode
  (left-padded, truncated from the left so the response end is kept);
- `last_token_scores`: logits (B, T) or (B, T, 1) -> (B,) at the last position with mask 1;
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
