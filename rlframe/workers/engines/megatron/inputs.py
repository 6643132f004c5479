"""A padded (B, T) micro-batch as megatron-core's GPTModel takes it: each row's valid run moved to
its left end and the micro-batch cut to the longest run.

A row of the batch is [left pad | prompt | response | right pad] (docs/contracts.md). Its valid run is
copied to columns 0..L-1, and the micro-batch keeps max(L) columns (rounded up to a multiple of tp
under sequence parallelism, which splits the sequence evenly): a 450-token sample of a 2048-wide
batch costs 450 tokens, and a micro-batch costs its own longest sample, not the batch's width.

Left-aligning is also what makes the positions right: megatron-core's rotary embedding takes the
position of a token from its column (it ignores `position_ids`), so a left-padded prompt would
start at its padding's width instead of 0; aligned, column j of a row is its position j, as
`position_ids` (and the fsdp engine and vLLM) have it.

megatron-core's local attention (`DotProductAttention`) applies the boolean mask it is given
(True = masked out) and no other; rlframe gives it causal AND key-is-valid. Query rows of padding
(after the run) attend to nothing valid; their outputs are never read. `to_batch` puts per-token
outputs back in the (B, T) columns they came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlframe.workers.engines.base import require_keys
from rlframe.workers.engines.packing import _valid_runs, next_token_labels


@dataclass
class MegatronInputs:
    input_ids: torch.Tensor  # (b, s): row i's valid run in columns 0..len_i-1, padding after it
    position_ids: torch.Tensor  # (b, s)
    mask: torch.Tensor  # (b, 1, s, s) bool, True = may NOT attend
    labels: torch.Tensor  # (b, s): the next token of each position in the (B, T) batch
    # the batch's tokens (not padding): row, column here and column of the (B, T) batch it came from
    rows: torch.Tensor
    cols: torch.Tensor
    batch_cols: torch.Tensor
    width: int  # T of the (B, T) batch
    stats: dict[str, int]

    def to_batch(self, values: torch.Tensor) -> torch.Tensor:
        """(b, s) per-token values -> (b, T) in the batch's columns, zero on padding (differentiable)."""
        out = values.new_zeros(values.shape[0], self.width)
        out[self.rows, self.batch_cols] = values[self.rows, self.cols]
        return out


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(b, s) 1/0 valid-token mask -> (b, 1, s, s) bool, True where query i may not attend key j."""
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None, :, :] & attention_mask.bool()[:, None, :]
    return ~allowed[:, None, :, :]


def megatron_inputs(data: dict[str, torch.Tensor], *, pad_token_id: int, multiple_of: int = 1) -> MegatronInputs:
    require_keys(data, ("input_ids", "attention_mask", "position_ids", "responses"), what="the engine's forward")
    ids, am = data["input_ids"], data["attention_mask"]
    b, t = ids.shape
    starts, lengths = _valid_runs(am)
    s = max(int(lengths.max()) if b else 0, 1)
    s += (-s) % multiple_of
    cols = torch.arange(s, device=ids.device)
    valid = cols[None, :] < lengths[:, None]
    source = (starts[:, None] + cols[None, :]).clamp(max=t - 1)

    def aligned(x: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.where(valid, x.gather(1, source), torch.full_like(source, fill))

    stats = {"tokens_valid": int(lengths.sum()), "tokens_computed": b * s, "tokens_padded": b * t}
    rows, kept = torch.nonzero(valid, as_tuple=True)  # once per micro-batch, for every output mapped back
    return MegatronInputs(input_ids=aligned(ids, pad_token_id), position_ids=aligned(data["position_ids"], 0),
                          mask=causal_padding_mask(valid), labels=aligned(next_token_labels(ids), pad_token_id),
                          rows=rows, cols=kept, batch_cols=source[rows, kept], width=t, stats=stats)
