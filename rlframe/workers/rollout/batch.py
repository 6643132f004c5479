"""Batch plumbing shared by the rollout backends: unpad prompts in, assemble the contract batch out.

In:  `input_ids` (B, P) left-padded, `attention_mask` (B, P).
Out (docs/contracts.md), with the n samples of a prompt adjacent (row b*n + j is sample j of prompt b):
  prompts (B*n, P), responses (B*n, R) right-padded with the pad id, response_mask (B*n, R),
  input_ids = cat(prompts, responses) (B*n, P+R), attention_mask (B*n, P+R),
  position_ids = clamp(cumsum(attention_mask) - 1, min=0) (B*n, P+R), rollout_log_probs (B*n, R).
R is `max_new_tokens`, so every rank and every step produces the same shapes.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from rlframe.utils.masks import position_ids_from_mask

PROMPT_KEYS = ("input_ids", "attention_mask")


def read_prompts(prompts: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of a DataProto or a mapping of tensors, validated: (B, P) each."""
    batch = prompts.batch if hasattr(prompts, "batch") else prompts
    if not isinstance(batch, Mapping) and not hasattr(batch, "keys"):
        raise ValueError(f"prompts must be a DataProto or a dict of tensors, got {type(prompts).__name__}")
    missing = [k for k in PROMPT_KEYS if k not in batch.keys()]
    if missing:
        raise ValueError(f"prompt batch lacks {missing}: rollout needs left-padded input_ids and attention_mask (B, P)")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if ids.dim() != 2 or ids.shape != mask.shape:
        raise ValueError(
            f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must both be (B, P)"
        )
    if ids.shape[1] and bool((mask[:, -1] == 0).any()):
        raise ValueError(
            "prompts must be left-padded (attention_mask 1 on the last column of every row); "
            "tokenize with padding_side='left'"
        )
    return ids.long().cpu(), mask.long().cpu()


def read_row_seeds(prompts: Any, sampling) -> list[int] | None:
    """The seed of each prompt row's first sample: the batch's `seed` tensor (B,) when the driver sent
    one (a function of the sample's global identity: rollout/seeds.py), else sampling.seed + b*n
    (rows numbered inside this call), else None (unseeded)."""
    batch = prompts.batch if hasattr(prompts, "batch") else prompts
    rows = batch["input_ids"].shape[0]
    if "seed" in batch.keys():
        seeds = batch["seed"]
        if seeds.shape != (rows,):
            raise ValueError(f"prompt batch key 'seed' has shape {tuple(seeds.shape)}; it must be ({rows},), "
                             "one seed per prompt row")
        return [int(s) for s in seeds.tolist()]
    if sampling.seed is None:
        return None
    return [sampling.seed + b * sampling.n for b in range(rows)]


def unpad_prompts(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The real tokens of each left-padded prompt row, as lists of ids."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def left_pad(rows: Sequence[Sequence[int]], *, pad_id: int, width: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of token lists left-padded to `width` (default: the longest row): the prompt
    layout `generate` takes."""
    width = max(len(r) for r in rows) if width is None else width
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def prompts_from_rows(rows: Sequence[Sequence[int]], *, pad_id: int) -> dict[str, torch.Tensor]:
    """The left-padded prompt tensors (input_ids, attention_mask, position_ids) of token lists."""
    ids, mask = left_pad(rows, pad_id=pad_id)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}


def assemble_batch(
    *,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    n: int,
    response_length: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Build the contract batch from per-sample response ids and log-probs (B*n lists, prompt-major).

    prompt_ids, prompt_mask: (B, P); responses[b*n + j], log_probs[b*n + j]: sample j of prompt b.
    """
    bsz, plen = prompt_ids.shape
    assert len(responses) == len(log_probs) == bsz * n, (len(responses), len(log_probs), bsz, n)
    resp = torch.full((bsz * n, response_length), pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros((bsz * n, response_length), dtype=torch.long)
    lp = torch.zeros((bsz * n, response_length), dtype=torch.float32)
    for i, (toks, lps) in enumerate(zip(responses, log_probs)):
        k = len(toks)
        assert k <= response_length and len(lps) == k, (k, len(lps), response_length)
        if k:
            resp[i, :k] = torch.as_tensor(list(toks), dtype=torch.long)
            lp[i, :k] = torch.as_tensor(list(lps), dtype=torch.float32)
            resp_mask[i, :k] = 1
    prompts = prompt_ids.repeat_interleave(n, dim=0)
    pmask = prompt_mask.repeat_interleave(n, dim=0)
    attention_mask = torch.cat([pmask, resp_mask], dim=1)
    return {
        "prompts": prompts,
        "responses": resp,
        "response_mask": resp_mask,
        "input_ids": torch.cat([prompts, resp], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "rollout_log_probs": lp,
    }


def to_data_proto(tensors: dict[str, torch.Tensor], *, meta_info: dict) -> Any:
    """Wrap the batch as a `DataProto` (rlframe.protocol) for the worker groups."""
    from rlframe.protocol import DataProto

    return DataProto.from_dict(tensors=tensors, meta_info=meta_info)
