"""Padding-free forward: pack the valid tokens of a micro-batch into as few rows as possible.

A micro-batch (B, T) = [left pad | prompt | response | right pad] has one contiguous run of valid
tokens per row. Packing puts whole runs into rows of capacity C = the longest run (first-fit
decreasing), so the model computes on rows * C tokens instead of B * T. Inside a row the runs are
separated by their position ids, which restart at 0: with `attention_mask` None (and no KV cache)
transformers' sdpa, eager and flex attention turn the resets into a block-diagonal causal mask.
Flash attention builds no mask; it infers boundaries from position ids only for a batch of one row,
so it gets them explicitly: `varlen_kwargs()` holds the cumulative sequence lengths over the
flattened (rows * C) tokens, which is how transformers' varlen path lays out the rows. Either way
packed tokens never attend across sequences. Rows never exceed C, so attention cost is at most that
of the padded batch, while the linear layers (most of the FLOPs) see almost only valid tokens.

Per-token results are computed in the packed layout and scattered back to (B, T).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass
class ModelInputs:
    """What the model runs on, and how to map its per-token outputs back to the (B, T) batch."""

    input_ids: torch.Tensor  # (rows, C)
    position_ids: torch.Tensor  # (rows, C)
    attention_mask: torch.Tensor | None  # (rows, C) when not packed; None when packed
    labels: torch.Tensor  # (rows, C) the next token of each position in the (B, T) batch
    src_index: torch.Tensor | None  # (N,) flat index into (B * T) of each valid token
    dst_index: torch.Tensor | None  # (N,) flat index into (rows * C) of the same token
    batch_shape: tuple[int, int]  # (B, T)
    tokens_valid: int
    # Packed only: start of each sequence in the flattened (rows * C) tokens, then rows * C (int32);
    # the empty slots at a row's end form one sequence of their own. And the longest sequence.
    cu_seq_lens: torch.Tensor | None = None
    max_seq_len: int = 0

    @property
    def tokens_computed(self) -> int:
        return self.input_ids.numel()

    def varlen_kwargs(self) -> dict:
        """Sequence boundaries as transformers' FlashAttentionKwargs (model forward keywords) for
        flash attention's variable-length path; empty when not packed."""
        if self.cu_seq_lens is None:
            return {}
        return {"cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": self.max_seq_len, "max_length_k": self.max_seq_len}

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """(rows, C) per-token values -> (B, T), zero on positions that were not computed."""
        if self.src_index is None:
            return values
        b, t = self.batch_shape
        out = values.new_zeros(b * t)
        out[self.src_index] = values.reshape(-1)[self.dst_index]
        return out.view(b, t)


def _valid_runs(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and length (B,) of the valid run of each row; ValueError if a row has holes."""
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    t = mask.shape[1]
    starts = torch.where(lengths > 0, mask.float().argmax(dim=1), torch.zeros_like(lengths))
    pos = torch.arange(t, device=mask.device)
    run = (pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])
    if not torch.equal(run, mask):
        bad = torch.nonzero((run != mask).any(dim=1)).flatten().tolist()
        raise ValueError(
            f"rows {bad[:8]} of the attention_mask have padding between valid tokens; batches must be "
            "cat(left-padded prompts, right-padded responses) (docs/contracts.md)"
        )
    return starts, lengths


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indices of `sizes` grouped into bins of at most `capacity` (largest first, first bin that fits)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        for b, load in enumerate(loads):
            if load + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])
    return bins


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): the token that follows each position (last column wraps; never used)."""
    return torch.roll(input_ids, shifts=-1, dims=1)


def padded_inputs(input_ids, attention_mask, position_ids) -> ModelInputs:
    """The batch as is: the model computes on every position, padding included."""
    return ModelInputs(
        input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
        labels=next_token_labels(input_ids), src_index=None, dst_index=None,
        batch_shape=tuple(input_ids.shape), tokens_valid=int(attention_mask.sum()),
    )


def pack_inputs(input_ids, attention_mask, position_ids, *, pad_token_id: int = 0) -> ModelInputs:
    """Pack the valid runs of (B, T) tensors into rows of capacity max(run length)."""
    b, t = input_ids.shape
    starts, lengths = _valid_runs(attention_mask)
    lens = lengths.tolist()
    cap = max(max(lens), 1)
    rows = first_fit_decreasing(lens, cap)
    src, dst, seq_lens = [], [], []
    for r, members in enumerate(rows):
        offset = 0
        for i in members:
            n = lens[i]
            s = int(starts[i])
            src.append(torch.arange(i * t + s, i * t + s + n))
            dst.append(torch.arange(r * cap + offset, r * cap + offset + n))
            offset += n
            if n:
                seq_lens.append(n)
        if offset < cap:
            seq_lens.append(cap - offset)
    device = input_ids.device
    src_index = torch.cat(src).to(device)
    dst_index = torch.cat(dst).to(device)

    def scatter(full: torch.Tensor, fill: int) -> torch.Tensor:
        out = full.new_full((len(rows) * cap,), fill)
        out[dst_index] = full.reshape(-1)[src_index]
        return out.view(len(rows), cap)

    # Empty slots at row ends get position 0: each is its own one-token sequence, so the mask
    # keeps them away from real tokens (and causality keeps real tokens away from them anyway).
    return ModelInputs(
        input_ids=scatter(input_ids, pad_token_id),
        position_ids=scatter(position_ids, 0),
        attention_mask=None,
        labels=scatter(next_token_labels(input_ids), pad_token_id),
        src_index=src_index, dst_index=dst_index, batch_shape=(b, t),
        tokens_valid=int(lengths.sum()),
        cu_seq_lens=torch.tensor([0, *accumulate(seq_lens)], dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens),
    )


def response_slice(per_token: torch.Tensor, response_length: int) -> torch.Tensor:
    """(B, T) next-token values -> (B, R): position P + r - 1 predicts response token r."""
    t = per_token.shape[1]
    return per_token[:, t - response_length - 1 : t - 1]
