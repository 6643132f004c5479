"""A seeded, resumable prompt dataloader: batches of left-padded prompts plus per-sample fields.

Order: each epoch draws a permutation of the dataset from one numpy Generator (seeded once), so
the sequence of batches is a function of the seed. `state_dict()` holds the epoch, the position
inside the epoch and the Generator's state as it was *before* drawing this epoch's permutation;
`load_state_dict` restores the three and redraws the same permutation, so the next batch after a
restore is exactly the batch that would have come next (checkpoint/resume, DESIGN.md section 8).

A batch is a plain dict (see `collate`): tensors `input_ids`, `attention_mask`, `position_ids`
of shape (B, P) with prompts left-padded to the longest prompt of the batch (or to `pad_to`),
and numpy object arrays `raw_prompt`, `data_source`, `ground_truth`, `extra_info`, `index`.
`to_dataproto(batch)` wraps it in `rlframe.protocol.DataProto`.
"""

from __future__ import annotations

import numpy as np

from rlframe.data.dataset import PromptRow
from rlframe.utils.masks import position_ids_from_mask

NON_TENSOR_KEYS = ("raw_prompt", "data_source", "ground_truth", "extra_info", "index")


def _object_array(values: list) -> np.ndarray:
    # Filling element by element keeps lists/dicts as single elements (np.array would nest them).
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def collate(rows: list[PromptRow], indices: list[int], *, pad_token_id: int, pad_to: int | None = None) -> dict:
    """Left-pad prompt ids into (B, P) tensors; per-sample fields become numpy object arrays.

    position_ids = clamp(cumsum(attention_mask) - 1, min=0), so the first real token is at 0.
    """
    import torch

    width = max(len(r.prompt_ids) for r in rows)
    if pad_to is not None:
        if pad_to < width:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt in the batch ({width} tokens)")
        width = pad_to
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.prompt_ids)
        ids[i, width - n :] = torch.tensor(r.prompt_ids, dtype=torch.long)
        mask[i, width - n :] = 1
    position_ids = position_ids_from_mask(mask)
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}
    batch["raw_prompt"] = _object_array([r.raw_prompt for r in rows])
    batch["data_source"] = _object_array([r.data_source for r in rows])
    batch["ground_truth"] = _object_array([r.ground_truth for r in rows])
    batch["extra_info"] = _object_array([r.extra_info for r in rows])
    batch["index"] = _object_array(list(indices))
    return batch


def to_dataproto(batch: dict, *, meta_info: dict | None = None):
    """Wrap a `collate` batch in a DataProto (tensors + non-tensor arrays + meta_info)."""
    from rlframe.protocol import DataProto

    tensors = {k: v for k, v in batch.items() if k not in NON_TENSOR_KEYS}
    non_tensors = {k: batch[k] for k in NON_TENSOR_KEYS if k in batch}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)


class StatefulDataLoader:
    """Seeded batches over a dataset with exact save/restore of the position.

    Args:
        dataset: indexable rows (`PromptDataset`).
        batch_size: prompts per batch.
        seed: seeds the shuffling Generator.
        shuffle: permute each epoch (False keeps file order).
        drop_last: drop the final partial batch of an epoch (the default: RL steps want equal batches).
        pad_token_id: the tokenizer's pad id.
        pad_to: pad every batch to this many prompt tokens (default: the batch's longest prompt).

    Iterating yields batches forever across epochs unless `max_epochs` is set. `len()` is the number
    of batches per epoch.
    """

    def __init__(self, dataset, *, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 pad_token_id: int, pad_to: int | None = None, max_epochs: int | None = None):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"dataset has {len(dataset)} prompts, fewer than one batch of {batch_size} with drop_last=True; "
                "lower data.train_batch_size or add data"
            )
        self.dataset, self.batch_size, self.shuffle, self.drop_last = dataset, batch_size, shuffle, drop_last
        self.pad_token_id, self.pad_to, self.max_epochs = pad_token_id, pad_to, max_epochs
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self.epoch = 0
        self.position = 0  # samples of this epoch's order already yielded
        self._start_epoch()

    def _start_epoch(self) -> None:
        self._epoch_rng_state = self._rng.bit_generator.state
        n = len(self.dataset)
        self._order = self._rng.permutation(n) if self.shuffle else np.arange(n)

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        n = len(self.dataset)
        remaining = n - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
                raise StopIteration
            self.epoch += 1
            self.position = 0
            self._start_epoch()
        idx = self._order[self.position : self.position + self.batch_size].tolist()
        self.position += len(idx)
        return collate([self.dataset[i] for i in idx], idx, pad_token_id=self.pad_token_id, pad_to=self.pad_to)

    def state_dict(self) -> dict:
        """Epoch, position within the epoch and the Generator state that drew this epoch's order."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "rng_state": self._epoch_rng_state, "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state["dataset_len"] != len(self.dataset):
            raise ValueError(
                f"dataloader state was saved for a dataset of {state['dataset_len']} prompts, but this one has "
                f"{len(self.dataset)}; resume with the same data files and max_prompt_length"
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = state["rng_state"]
        self._start_epoch()
