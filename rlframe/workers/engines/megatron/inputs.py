"""A padded (B, T) micro-batch as megatron-core's GPTModel takes it.

megatron-core's local attention (`DotProductAttention`) applies the boolean mask it is given
(True = masked out) and no other; rlframe gives it causal AND key-is-valid, so left-padded prompts
and right-padded responses attend exactly like the fsdp engine's. Query rows of padding attend to
nothing valid; their outputs are never read. With sequence parallelism the sequence is padded on
the right to a multiple of tp (megatron splits it evenly); `length` is the original T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlframe.workers.engines.base import require_keys
from rlframe.workers.engines.packing import next_token_labels


@dataclass
class MegatronInputs:
    input_ids: torch.Tensor  # (b, s)
    position_ids: torch.Tensor  # (b, s)
    mask: torch.Tensor  # (b, 1, s, s) bool, True = may NOT attend
    labels: torch.Tensor  # (b, s): the next token of each position
    length: int  # T before padding to a multiple
    stats: dict[str, int]


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(b, s) 1/0 valid-token mask -> (b, 1, s, s) bool, True where query i may not attend key j."""
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None, :, :] & attention_mask.bool()[:, None, :]
    return ~allowed[:, None, :, :]


def megatron_inputs(data: dict[str, torch.Tensor], *, pad_token_id: int, multiple_of: int = 1) -> MegatronInputs:
    require_keys(data, ("input_ids", "attention_mask", "position_ids", "responses"), what="the engine's forward")
    ids, am, pos = data["input_ids"], data["attention_mask"], data["position_ids"]
    b, t = ids.shape
    extra = (-t) % multiple_of
    if extra:
        ids = F.pad(ids, (0, extra), value=pad_token_id)
        am = F.pad(am, (0, extra), value=0)
        pos = F.pad(pos, (0, extra), value=0)
    stats = {"tokens_valid": int(data["attention_mask"].sum()), "tokens_computed": int(ids.numel()),
             "tokens_padded": b * t}
    return MegatronInputs(input_ids=ids, position_ids=pos, mask=causal_padding_mask(am),
                          labels=next_token_labels(ids), length=t, stats=stats)
