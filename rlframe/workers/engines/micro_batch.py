"""Split a batch into micro-batches (fixed size or a token budget) that every dp rank can run.

FSDP2 all-gathers parameters inside every forward and backward, so all data-parallel ranks must
run the same number of micro-batches or they deadlock. `plan_micro_batches` agrees on the largest
count over the dp group and tops up short ranks with zero-weight micro-batches (a real sample whose
loss is multiplied by 0: the collectives happen, the gradient is unchanged).

With `max_tokens_per_micro_batch` (dynamic batching) samples are grouped by their valid-token
count (first-fit decreasing, the cost of a padding-free forward), so micro-batches hold many short
sequences or few long ones. Outputs are put back in the original sample order by `restore_order`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from rlframe.workers.engines.base import as_tensor_dict
from rlframe.workers.engines.packing import first_fit_decreasing


@dataclass
class MicroBatch:
    data: dict[str, torch.Tensor]  # tensors with a leading batch dim
    index: torch.Tensor | None  # (b,) positions of these samples in the caller's batch (None: given list)
    weight_scale: float = 1.0  # 0 for padding micro-batches that only keep collectives in step

    @property
    def size(self) -> int:
        return int(next(iter(self.data.values())).shape[0])


def select(batch: Mapping[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[index] for k, v in batch.items() if isinstance(v, torch.Tensor)}


def batch_size_of(batch: Mapping[str, torch.Tensor]) -> int:
    sizes = {k: int(v.shape[0]) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if not sizes or len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors must share a non-empty leading batch dim; got sizes {sizes}")
    return next(iter(sizes.values()))


def split_indices(
    valid_tokens: Sequence[int], *, micro_batch_size: int | None, max_tokens: int | None
) -> list[list[int]]:
    """Sample indices per micro-batch: by token budget if given, else fixed size, else one."""
    n = len(valid_tokens)
    if max_tokens is not None:
        longest = max(valid_tokens)
        if longest > max_tokens:
            raise ValueError(
                f"a sample has {longest} valid tokens, more than max_tokens_per_micro_batch="
                f"{max_tokens}; raise the budget to at least the longest prompt+response"
            )
        return [sorted(b) for b in first_fit_decreasing(list(valid_tokens), max_tokens)]
    if micro_batch_size is not None:
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    return [list(range(n))]


def agree_on_count(count: int, group) -> int:
    """The largest micro-batch count over `group` (every dp rank must run that many)."""
    if group is None or dist.get_world_size(group) == 1:
        return count
    t = torch.tensor([count], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def plan_micro_batches(
    batch_or_list, *, micro_batch_size: int | None, max_tokens: int | None, dp_group
) -> list[MicroBatch]:
    """Micro-batches for this rank, as many as on every other dp rank (see module docstring)."""
    if isinstance(batch_or_list, (list, tuple)):
        if not batch_or_list:
            raise ValueError("train_step got an empty list of micro-batches")
        mbs = [MicroBatch(dict(as_tensor_dict(b)), None) for b in batch_or_list]
    else:
        batch = as_tensor_dict(batch_or_list)
        batch_size_of(batch)
        valid = batch["attention_mask"].sum(dim=1).tolist()
        groups = split_indices(valid, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
        mbs = []
        for g in groups:
            idx = torch.tensor(g, dtype=torch.long)
            mbs.append(MicroBatch(select(batch, idx), idx))
    target = agree_on_count(len(mbs), dp_group)
    filler = {k: v[:1] for k, v in mbs[0].data.items()}
    mbs += [MicroBatch(filler, None, weight_scale=0.0) for _ in range(target - len(mbs))]
    return mbs


def restore_order(outputs: list[torch.Tensor], mbs: list[MicroBatch]) -> torch.Tensor:
    """Concatenate per-micro-batch outputs (b_i, ...) back into the caller's sample order."""
    real = [(o, mb) for o, mb in zip(outputs, mbs) if mb.weight_scale != 0.0]
    out = torch.cat([o for o, _ in real])
    if all(mb.index is None for _, mb in real):
        return out
    index = torch.cat([mb.index for _, mb in real]).to(out.device)
    result = torch.empty_like(out)
    result[index] = out
    return result
