"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) for the fsdp engine.

With `sp = k` the k ranks of an "sp" group hold the same micro-batch and each computes 1/k of its
positions: the packed (or padded) rows are padded to a multiple of k columns and rank r keeps
columns [r * L/k, (r + 1) * L/k). Everything but attention is position-wise, so it runs on the
local columns as is: embeddings, norms, MLPs, the LM head (rotary embeddings too, since each rank
passes its columns' global position ids). Attention needs every position, so around it:

  q, k, v (rows, H, L/k, D)  --all-to-all-->  (rows, H/k, L, D)   every position, 1/k of the heads
  attention over the whole rows (the packed sequences' block-diagonal causal mask, or the padded
  rows' causal mask over their valid keys, built once per micro-batch from the global columns)
  output (rows, L, H/k, D)   --all-to-all-->  (rows, L/k, H, D)   back to this rank's columns

(with tensor parallelism H is the rank's tp share of the heads). Key/value heads that do not split
over k (fewer than k per tp rank) are repeated to the query heads first. Per-token results
(log-probs, entropy, values) are gathered over the sp group into whole rows, so the loss is the
same computation on every sp rank as without sp; the gather's backward sums the k identical
gradients and hands each rank its columns' share, and FSDP, which shards and averages gradients
over dp x sp, divides that factor k away again: the step equals the one-process step.

Every attention implementation the engine can pick works underneath: sdpa / sdpa_fp32 get the
explicit boolean mask (none for rows that are one sequence each), eager the same as an additive one;
flash attention gets the segments' boundaries (cu_seq_lens) of the whole rows instead, so no (L, L)
mask is built on GPU. A model's sliding window goes into the mask (flash applies it itself). With
dropout on (LoRA's), each sp rank draws its own masks (`rank_rng`), as the positions of one process do.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlframe.workers.engines.packing import ModelInputs

PREFIX = "ulysses_"


@dataclass
class SequenceSplit:
    """One micro-batch split over the sp group: this rank's columns and what attention needs."""

    group: dist.ProcessGroup
    size: int
    rank: int
    length: int  # columns of the whole (padded to a multiple of size) rows
    columns: int  # columns before that padding
    seq_ids: torch.Tensor  # (rows, length): which sequence each column belongs to
    key_valid: torch.Tensor  # (rows, length): columns other positions may attend to
    cu_seq_lens: torch.Tensor  # flash attention: segment starts over the flattened rows, then rows * L
    max_seq_len: int
    causal_only: bool = False
    _masks: dict = field(default_factory=dict)  # sliding window (None: none) -> mask

    def local(self, t: torch.Tensor) -> torch.Tensor:
        n = self.length // self.size
        return t[:, self.rank * n:(self.rank + 1) * n]

    def mask(self, *, window: int | None = None, always: bool = False) -> torch.Tensor | None:
        """(rows, 1, L, L) bool: causal, within one sequence, to valid keys, and to the last `window`
        positions with a sliding window; a query with no key allowed (a left pad) attends to itself,
        so no softmax row is empty (its output is unused). None (plain causal attention, no mask
        built) when each row's columns before the sp padding are one sequence of valid tokens and
        there is no window (causality alone then keeps them from the padding after them), unless
        `always`. Built once per micro-batch and window."""
        if self.causal_only and window is None and not always:
            return None
        if window not in self._masks:
            n = self.length
            pos = torch.arange(n, device=self.seq_ids.device)
            allowed = (pos[None, :] <= pos[:, None])[None] & (self.seq_ids[:, :, None] == self.seq_ids[:, None, :])
            allowed &= self.key_valid[:, None, :].bool()
            if window is not None:
                allowed &= (pos[:, None] - pos[None, :] < window)[None]
            allowed |= torch.eye(n, dtype=torch.bool, device=allowed.device)
            self._masks[window] = allowed[:, None]
        return self._masks[window]


_current: SequenceSplit | None = None


def split_inputs(inputs: ModelInputs, *, group, pad_token_id: int) -> tuple[ModelInputs, SequenceSplit]:
    """This rank's columns of `inputs` (as ModelInputs the model runs on) and the split that the
    attention wrapper reads. The split stays current until the next call: activation checkpointing
    recomputes attention in the backward, after the forward returned."""
    global _current
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, cols = inputs.input_ids.shape
    length = -(-cols // size) * size
    pad = length - cols

    def padded(t, fill):
        return torch.nn.functional.pad(t, (0, pad), value=fill) if pad else t

    position_ids = padded(inputs.position_ids, 0)
    if inputs.attention_mask is None:  # packed: a sequence starts wherever positions do not go on by one
        starts = torch.diff(position_ids, dim=1, prepend=position_ids[:, :1] - 1) != 1
        key_valid = torch.ones_like(position_ids, dtype=torch.bool)
    else:  # padded: the left padding, the valid run and the right padding are segments of their own
        key_valid = padded(inputs.attention_mask, 0).bool()
        starts = torch.diff(key_valid.int(), dim=1, prepend=(~key_valid[:, :1]).int()) != 0
    starts[:, 0] = True  # every row starts a segment (flash attention's rows are flattened)
    seq_ids = starts.cumsum(dim=1)
    bounds = torch.cat([starts.reshape(-1).nonzero().flatten(),
                        torch.tensor([rows * length], device=starts.device)])
    cu, longest = bounds.to(torch.int32), int((bounds[1:] - bounds[:-1]).max())
    causal_only = bool((seq_ids[:, :cols] == seq_ids[:, :1]).all() and key_valid[:, :cols].all())
    split = SequenceSplit(group=group, size=size, rank=rank, length=length, columns=cols, seq_ids=seq_ids,
                          key_valid=key_valid, cu_seq_lens=cu, max_seq_len=longest, causal_only=causal_only)
    local = ModelInputs(
        input_ids=split.local(padded(inputs.input_ids, pad_token_id)), position_ids=split.local(position_ids),
        attention_mask=None, labels=split.local(padded(inputs.labels, pad_token_id)), src_index=None,
        dst_index=None, batch_shape=(rows, length // size), tokens_valid=inputs.tokens_valid)
    _current = split
    return local, split


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """Block i of dim 0 goes to rank i; block i of the result came from rank i (differentiable:
    the backward is the reverse all-to-all)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(send, None, None, group))


def release() -> None:
    """Drop the current split (and its masks) once a step's backward, or a forward-only pass, is over."""
    global _current
    _current = None


@contextmanager
def rank_rng(split: SequenceSplit):
    """Random draws (LoRA dropout) that differ between the sp ranks, as they would between the
    positions of one process: a seed drawn from the shared generator (the same on every sp rank, so
    it advances alike) plus the rank. Activation checkpointing replays the state it saw here."""
    seed = int(torch.randint(0, 2**62, (1,)))
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + split.rank)
        yield


def _heads_to_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """(rows, H, L/k, D) local columns, all heads -> (rows, H/k, L, D) all columns, this rank's heads."""
    b, h, n, d = x.shape
    send = x.reshape(b, size, h // size, n, d).transpose(0, 1).contiguous()  # (k, rows, H/k, L/k, D)
    recv = _all_to_all(send, group)  # [i]: rank i's columns
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * n, d)


def _sequence_to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """(rows, L, H/k, D) all columns, this rank's heads -> (rows, L/k, H, D) local columns, all heads."""
    b, n, h, d = x.shape
    send = x.reshape(b, size, n // size, h, d).transpose(0, 1).contiguous()  # (k, rows, L/k, H/k, D)
    recv = _all_to_all(send, group)  # [i]: heads of rank i
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n // size, size * h, d)


class _Delegate:
    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _WrappedModule(_Delegate):
    """The attention module as the wrapped implementation sees it: key/value heads already repeated,
    and a config naming the wrapped implementation (flash attention picks its kernel by that name)."""

    def __init__(self, module, groups: int, base: str):
        super().__init__(module)
        self.num_key_value_groups = groups
        self.config = _Delegate(module.config)
        self.config._attn_implementation = base


def _implementation(base: str, module):
    """transformers' attention function `base`; "eager" is each model's own (in its modeling module)."""
    import sys

    from transformers import AttentionInterface

    if base == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return AttentionInterface()[base]


def _attention(base: str):
    from transformers.integrations.sdpa_attention import repeat_kv

    def forward(module, query, key, value, attention_mask, **kwargs):
        split = _current
        assert split is not None, "Ulysses attention ran outside the engine's split_inputs"
        k, heads, kv_heads = split.size, query.shape[1], key.shape[1]
        if heads % k:
            raise ValueError(f"Ulysses: {heads} attention heads per tensor-parallel rank do not split over sp={k}")
        groups = getattr(module, "num_key_value_groups", 1)
        if kv_heads % k:  # repeat kv heads to the query heads, then split those
            key, value, groups = repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads), 1
        q, kk, v = (_heads_to_sequence(t, split.group, k) for t in (query, key, value))
        impl = _implementation(base, module)
        if "flash" in base:  # flash applies causality and a sliding window itself
            kwargs.update(cu_seq_lens_q=split.cu_seq_lens, cu_seq_lens_k=split.cu_seq_lens,
                          max_length_q=split.max_seq_len, max_length_k=split.max_seq_len)
            kwargs.pop("position_ids", None)
            mask = None
        else:
            # eager applies causality only through its mask, and adds the mask to the scores
            mask = split.mask(window=kwargs.get("sliding_window"), always=base == "eager")
            if base == "eager":
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, torch.finfo(q.dtype).min)
        out, _ = impl(_WrappedModule(module, groups, base), q, kk, v, mask, **kwargs)
        return _sequence_to_heads(out, split.group, k), None

    return forward


def attention_implementation(base: str) -> str:
    """Register the Ulysses wrapper around transformers' attention `base` (and a mask function that
    builds nothing: the wrapper builds the mask of the whole rows); return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # not "flash" in the name: transformers would load a flash kernel for the wrapper's name itself
    name = PREFIX + base.replace("flash_attention", "fa")
    AttentionInterface.register(name, _attention(base))
    AttentionMaskInterface.register(name, lambda *args, **kwargs: None)
    return name


class _GatherColumns(torch.autograd.Function):
    """All-gather (rows, L/k) columns into (rows, L); backward: the sum of every rank's gradient
    (each rank computed the same loss from the gathered rows), this rank's columns of it."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.group, ctx.rank, ctx.n = group, rank, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None, None, None


def gather_columns(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """This rank's per-token (rows, L/k) results as the whole rows (rows, columns), the sp padding cut."""
    return _GatherColumns.apply(x, split.group, split.size, split.rank)[:, :split.columns]
