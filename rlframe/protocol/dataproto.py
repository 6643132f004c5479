"""DataProto: the batch type (see the package docstring, rlframe/protocol/__init__.py, for its contract).

Validation helpers live in `checks`, the out-of-band pickling in `serialize`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from rlframe.protocol import serialize as wire
from rlframe.protocol.serialize import receive_zero_copy
from rlframe.protocol.checks import (
    check_index,
    check_keys_exist,
    check_mask_length,
    merge_meta,
    non_tensor_array,
    values_equal,
)

__all__ = ["DataProto", "receive_zero_copy"]


@dataclass(eq=False, repr=False)
class DataProto:
    """A batch of B samples: tensors (B, ...), per-sample numpy arrays (B,), and batch settings.

    Example:
        >>> dp = DataProto.from_dict(
        ...     tensors={"input_ids": torch.zeros(4, 6, dtype=torch.long)},
        ...     non_tensors={"uid": ["a", "b", "c", "d"]},
        ...     meta_info={"temperature": 1.0},
        ... )
        >>> len(dp), [len(c) for c in dp.chunk(2)]
        (4, [2, 2])
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.non_tensor_batch = dict(self.non_tensor_batch or {})
        self.meta_info = dict(self.meta_info or {})
        if self.batch is not None:
            self.batch = _as_batched_tensordict(self.batch)
        self._check_consistent()

    # ---------------------------------------------------------------- construction and checks
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Sequence[Any] | np.ndarray] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> "DataProto":
        """Build from plain dicts; lists of per-sample values become numpy object arrays."""
        tensors = dict(tensors or {})
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"DataProto: tensor field {key!r} is a {type(value).__name__}, not a "
                    "torch.Tensor; pass per-sample Python values under non_tensors instead"
                )
        _check_tensor_sizes(tensors)
        batch = None
        if tensors:
            b = next(iter(tensors.values())).shape[0]
            batch = TensorDict(tensors, batch_size=[b])
        nt = {key: non_tensor_array(key, value) for key, value in (non_tensors or {}).items()}
        return cls(batch=batch, non_tensor_batch=nt, meta_info=dict(meta_info or {}))

    def _check_consistent(self) -> None:
        """Every field has the same number of rows; no key is both a tensor and a non-tensor."""
        ref_key, ref_len, ref_kind = None, None, None
        if self.batch is not None:
            # An empty TensorDict still fixes B (e.g. after select of non-tensor keys only).
            ref_key = next(iter(self.batch.keys()), "batch_size")
            ref_len, ref_kind = int(self.batch.batch_size[0]), "tensor"
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray) or value.ndim != 1:
                what = f"a {value.ndim}-D array" if isinstance(value, np.ndarray) else type(value).__name__
                raise ValueError(
                    f"DataProto: non-tensor {key!r} must be a 1-D numpy array of length B, got {what}; "
                    "use DataProto.from_dict, which converts lists to object arrays, or "
                    "np.array(values, dtype=object)"
                )
            if self.batch is not None and key in self.batch.keys():
                raise ValueError(
                    f"DataProto: key {key!r} is both a tensor and a non-tensor field; "
                    "rename one of them (DataProto.rename) so each key means one thing"
                )
            if ref_len is None:
                ref_key, ref_len, ref_kind = key, len(value), "non-tensor"
            elif len(value) != ref_len:
                raise ValueError(
                    f"DataProto: non-tensor {key!r} has length {len(value)} but {ref_kind} "
                    f"{ref_key!r} has {ref_len}; all fields must share the first dimension"
                )

    # --------------------------------------------------------------------------- basic access
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return len(value)
        return 0

    @property
    def batch_keys(self) -> list[str]:
        return [] if self.batch is None else list(self.batch.keys())

    @property
    def non_tensor_keys(self) -> list[str]:
        return list(self.non_tensor_batch.keys())

    def __repr__(self) -> str:
        lines = [f"DataProto(len={len(self)}"]
        if self.batch is not None:
            for key, t in self.batch.items():
                lines.append(f"  {key}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}")
        for key, arr in self.non_tensor_batch.items():
            lines.append(f"  {key}: ({len(arr)},) numpy {arr.dtype} (non-tensor)")
        if self.meta_info:
            lines.append(f"  meta_info: {self.meta_info!r}")
        return "\n".join(lines) + ")"

    def __getitem__(self, item) -> "DataProto | torch.Tensor | np.ndarray":
        """`dp["input_ids"]` returns that field; any other index selects rows (see `index`)."""
        if isinstance(item, str):
            if self.batch is not None and item in self.batch.keys():
                return self.batch[item]
            if item in self.non_tensor_batch:
                return self.non_tensor_batch[item]
            raise KeyError(
                f"DataProto: no field {item!r}; tensor keys: {self.batch_keys}, "
                f"non-tensor keys: {self.non_tensor_keys}"
            )
        return self.index(item)

    def index(self, idx) -> "DataProto":
        """Rows selected by an int (kept as a batch of 1), a slice, a list/array/tensor of int
        indices, or a bool mask of length B. Slices are views; index lists copy."""
        n = len(self)
        if isinstance(idx, (int, np.integer)):
            i = check_index(int(idx), n)
            idx = slice(i, i + 1)
        if isinstance(idx, slice) and (idx.step or 1) < 0:
            idx = list(range(*idx.indices(n)))  # torch has no negative-step views
        if isinstance(idx, slice):
            np_idx, t_idx = idx, idx
        else:
            np_idx = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx)
            if np_idx.dtype == np.bool_:
                check_mask_length(np_idx, n)
                np_idx = np.nonzero(np_idx)[0]
            elif np_idx.size == 0:
                np_idx = np_idx.astype(np.int64)
            elif not np.issubdtype(np_idx.dtype, np.integer) or np_idx.ndim != 1:
                raise ValueError(
                    f"DataProto.index: expected an int, a slice, a 1-D sequence of ints or a bool "
                    f"mask, got an array of dtype {np_idx.dtype} and shape {np_idx.shape}"
                )
            for bad in np_idx[(np_idx >= n) | (np_idx < -n)][:1]:
                check_index(int(bad), n)
            t_idx = torch.as_tensor(np_idx, dtype=torch.long)
        batch = None if self.batch is None else self.batch[t_idx]
        nt = {k: v[np_idx] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=nt, meta_info=dict(self.meta_info))

    # ------------------------------------------------------------------ select / pop / rename
    def select(self, batch_keys=None, non_tensor_keys=None, meta_info_keys=None) -> "DataProto":
        """A DataProto with only the named keys; None keeps every key of that kind. Shares storage."""
        return self._take(batch_keys, non_tensor_keys, meta_info_keys, remove=False, op="select")

    def pop(self, batch_keys=None, non_tensor_keys=None, meta_info_keys=None) -> "DataProto":
        """Remove the named keys from `self` (in place) and return them; None removes nothing."""
        return self._take(
            batch_keys or [], non_tensor_keys or [], meta_info_keys or [], remove=True, op="pop"
        )

    def _take(self, batch_keys, non_tensor_keys, meta_info_keys, *, remove: bool, op: str) -> "DataProto":
        b_keys = self.batch_keys if batch_keys is None else list(batch_keys)
        nt_keys = self.non_tensor_keys if non_tensor_keys is None else list(non_tensor_keys)
        m_keys = list(self.meta_info) if meta_info_keys is None else list(meta_info_keys)
        check_keys_exist(op, "tensor", b_keys, self.batch_keys)
        check_keys_exist(op, "non-tensor", nt_keys, self.non_tensor_keys)
        check_keys_exist(op, "meta_info", m_keys, list(self.meta_info))
        batch = None
        if self.batch is not None and b_keys:
            batch = self.batch.select(*b_keys)
        elif self.batch is not None and not nt_keys:
            # Keep B even when no field is selected, so len() of the result stays meaningful.
            batch = TensorDict({}, batch_size=self.batch.batch_size)
        nt = {k: self.non_tensor_batch[k] for k in nt_keys}
        meta = {k: self.meta_info[k] for k in m_keys}
        if remove:
            if b_keys:
                self.batch = self.batch.exclude(*b_keys)
            for k in nt_keys:
                del self.non_tensor_batch[k]
            for k in m_keys:
                del self.meta_info[k]
        return DataProto(batch=batch, non_tensor_batch=nt, meta_info=meta)

    def rename(self, mapping: dict[str, str]) -> "DataProto":
        """A DataProto with tensor/non-tensor keys renamed by `mapping` (old -> new). Shares storage."""
        all_keys = self.batch_keys + self.non_tensor_keys
        check_keys_exist("rename", "field", list(mapping), all_keys)
        new_names = [mapping.get(k, k) for k in all_keys]
        if len(set(new_names)) != len(new_names):
            dup = sorted({k for k in new_names if new_names.count(k) > 1})
            raise ValueError(
                f"DataProto.rename: renaming {mapping} gives duplicate keys {dup}; "
                "pop or rename the existing field first"
            )
        tensors = {mapping.get(k, k): v for k, v in self.batch.items()} if self.batch is not None else {}
        nt = {mapping.get(k, k): v for k, v in self.non_tensor_batch.items()}
        batch = None if self.batch is None else TensorDict(tensors, batch_size=self.batch.batch_size)
        return DataProto(batch=batch, non_tensor_batch=nt, meta_info=dict(self.meta_info))

    # --------------------------------------------------------------------- combine and split
    def union(self, other: "DataProto") -> "DataProto":
        """All fields of `self` and `other` (same B). A key in both must hold equal values."""
        if len(self) != len(other):
            raise ValueError(
                f"DataProto.union: batch sizes differ ({len(self)} vs {len(other)}); "
                "union joins fields of the same samples, so both sides need the same rows"
            )
        tensors = dict(self.batch.items()) if self.batch is not None else {}
        for key, value in (other.batch.items() if other.batch is not None else []):
            if key in tensors and not _tensors_equal(tensors[key], value):
                raise ValueError(
                    f"DataProto.union: tensor {key!r} differs between the two sides "
                    f"({tuple(tensors[key].shape)} {tensors[key].dtype} vs {tuple(value.shape)} "
                    f"{value.dtype}); pop it from one side or rename it"
                )
            tensors[key] = value
        nt = dict(self.non_tensor_batch)
        for key, value in other.non_tensor_batch.items():
            if key in nt and not values_equal(nt[key], value):
                raise ValueError(
                    f"DataProto.union: non-tensor {key!r} differs between the two sides "
                    f"(length {len(nt[key])} vs {len(value)}); pop it from one side or rename it"
                )
            nt[key] = value
        meta = merge_meta("union", [self.meta_info, other.meta_info], require_same_keys=False)
        batch = None
        if self.batch is not None or other.batch is not None:
            batch = TensorDict(tensors, batch_size=[len(self)])
        return DataProto(batch=batch, non_tensor_batch=nt, meta_info=meta)

    @staticmethod
    def concat(parts: Sequence["DataProto"], *, gather_meta_keys: Sequence[str] = ()) -> "DataProto":
        """Rows of all parts in order. Parts need the same keys and equal meta_info.

        `gather_meta_keys` names per-part values that are expected to differ (e.g. each rank's
        `gen_time_s`): the result holds them as a list with one entry per part (None where a part
        lacks the key) instead of raising.
        """
        parts = list(parts)
        if not parts:
            raise ValueError("DataProto.concat: got an empty list; pass at least one DataProto")
        first = parts[0]
        for i, p in enumerate(parts[1:], start=1):
            for kind, a, b in (("tensor", first.batch_keys, p.batch_keys),
                               ("non-tensor", first.non_tensor_keys, p.non_tensor_keys)):
                if set(a) != set(b):
                    raise ValueError(
                        f"DataProto.concat: part {i} has {kind} keys {sorted(b)} but part 0 has "
                        f"{sorted(a)}; every part must carry the same fields"
                    )
        gathered = {k: [p.meta_info.get(k) for p in parts] for k in gather_meta_keys}
        metas = [{k: v for k, v in p.meta_info.items() if k not in gathered} for p in parts]
        meta = merge_meta("concat", metas, require_same_keys=True)
        meta.update(gathered)
        total = sum(len(p) for p in parts)
        batch = None
        if first.batch_keys:
            batch = TensorDict(
                {k: torch.cat([p.batch[k] for p in parts]) for k in first.batch_keys}, batch_size=[total]
            )
        elif first.batch is not None and not first.non_tensor_keys:
            batch = TensorDict({}, batch_size=[total])
        nt = {k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in first.non_tensor_keys}
        return DataProto(batch=batch, non_tensor_batch=nt, meta_info=meta)

    def chunk(self, n: int) -> list["DataProto"]:
        """n equal parts (views). n must divide len(self): pad first with `pad_to_divisor(n)`."""
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"DataProto.chunk: n must be a positive int, got {n!r}")
        if len(self) % n != 0:
            raise ValueError(
                f"DataProto.chunk: batch size {len(self)} is not divisible by {n}; call "
                f"`padded, pad = dp.pad_to_divisor({n})`, chunk `padded`, and `unpad(pad)` after concat"
            )
        return self.split(len(self) // n) if len(self) else [self.index(slice(0, 0)) for _ in range(n)]

    def split(self, size: int) -> list["DataProto"]:
        """Consecutive parts of `size` rows (views); the last part may be smaller."""
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"DataProto.split: size must be a positive int, got {size!r}")
        return [self.index(slice(s, s + size)) for s in range(0, len(self), size)]

    def repeat(self, n: int, *, interleave: bool = True) -> "DataProto":
        """Each row n times: interleave gives [a, a, b, b] (n samples per prompt, GRPO), tiled
        gives [a, b, a, b]. Copies."""
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"DataProto.repeat: n must be a positive int, got {n!r}")
        base = torch.arange(len(self))
        idx = base.repeat_interleave(n) if interleave else base.repeat(n)
        return self.index(idx)

    def reorder(self, indices) -> None:
        """Permute rows in place: row i becomes old row indices[i] (e.g. for sequence balancing)."""
        idx = torch.as_tensor(np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices))
        if idx.dtype == torch.bool or idx.numel() != len(self):
            raise ValueError(
                f"DataProto.reorder: expected {len(self)} int indices (a permutation), got "
                f"{idx.numel()} of dtype {idx.dtype}; use dp[indices] to select a subset"
            )
        if not torch.equal(torch.sort(idx % max(len(self), 1)).values, torch.arange(len(self))):
            raise ValueError(
                f"DataProto.reorder: indices are not a permutation of range({len(self)}) (repeated "
                "or out-of-range rows); use dp[indices] to select rows with repeats"
            )
        moved = self.index(idx)
        self.batch, self.non_tensor_batch = moved.batch, moved.non_tensor_batch

    # ---------------------------------------------------------------------------- padding
    def pad_to_divisor(self, divisor: int) -> tuple["DataProto", int]:
        """(padded, pad_size): rows appended, repeated from the start, so len % divisor == 0.

        Lets a batch of any size be split over `divisor` data-parallel ranks; the padded rows are
        real samples (no special values) and `unpad(pad_size)` drops them after gathering.
        """
        if not isinstance(divisor, int) or divisor <= 0:
            raise ValueError(f"DataProto.pad_to_divisor: divisor must be a positive int, got {divisor!r}")
        pad_size = (-len(self)) % divisor
        if pad_size == 0:
            return self, 0  # already divisible: `self`, not a copy
        pad = self.index(torch.arange(pad_size) % len(self))
        return DataProto.concat([self, pad]), pad_size

    def unpad(self, pad_size: int) -> "DataProto":
        """Drop the last `pad_size` rows (the ones `pad_to_divisor` added)."""
        if not isinstance(pad_size, int) or not 0 <= pad_size <= len(self):
            raise ValueError(
                f"DataProto.unpad: pad_size must be an int in [0, {len(self)}], got {pad_size!r}"
            )
        return self.index(slice(0, len(self) - pad_size))

    # --------------------------------------------------------------------- iteration, device
    def iter_minibatches(
        self, size: int, *, shuffle: bool = False, seed: int | None = None, epochs: int = 1
    ) -> Iterator["DataProto"]:
        """Minibatches of `size` rows for `epochs` passes; the last of each pass may be smaller.

        With shuffle, each pass uses a fresh permutation drawn from one torch.Generator seeded
        with `seed` (so the sequence of passes is reproducible).
        """
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"DataProto.iter_minibatches: size must be a positive int, got {size!r}")
        if not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"DataProto.iter_minibatches: epochs must be an int >= 0, got {epochs!r}")
        gen = torch.Generator()
        gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        for _ in range(epochs):
            source = self.index(torch.randperm(len(self), generator=gen)) if shuffle else self
            yield from source.split(size)

    def to(self, device: str | torch.device) -> "DataProto":
        """A DataProto whose tensors are on `device` (non-tensors and meta_info are shared)."""
        batch = None if self.batch is None else self.batch.to(device)
        return DataProto(
            batch=batch, non_tensor_batch=dict(self.non_tensor_batch), meta_info=dict(self.meta_info)
        )

    def equals(self, other: "DataProto") -> bool:
        """Exact equality of keys, dtypes, shapes, values and meta_info (devices may differ)."""
        if not isinstance(other, DataProto) or len(self) != len(other):
            return False
        if set(self.batch_keys) != set(other.batch_keys):
            return False
        if set(self.non_tensor_keys) != set(other.non_tensor_keys):
            return False
        if any(not _tensors_equal(self.batch[k], other.batch[k]) for k in self.batch_keys):
            return False
        if any(not values_equal(v, other.non_tensor_batch[k]) for k, v in self.non_tensor_batch.items()):
            return False
        return values_equal(self.meta_info, other.meta_info)

    # ------------------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        return {
            "version": wire.STATE_VERSION,
            "batch": wire.batch_to_state(self.batch),
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        assert state.get("version") == wire.STATE_VERSION, (
            f"DataProto pickle version {state.get('version')} != {wire.STATE_VERSION}"
        )
        self.batch = wire.batch_from_state(state["batch"])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def _check_tensor_sizes(tensors: dict[str, torch.Tensor]) -> None:
    """All tensors have at least one dim and the same first dim; the error names both keys."""
    ref_key, ref_b = None, None
    for key, t in tensors.items():
        if t.dim() == 0:
            raise ValueError(
                f"DataProto: tensor {key!r} is a scalar (shape ()); batch tensors need a first "
                "dimension of size B; put per-batch values in meta_info"
            )
        if ref_key is None:
            ref_key, ref_b = key, t.shape[0]
        elif t.shape[0] != ref_b:
            raise ValueError(
                f"DataProto: tensor {key!r} has batch size {t.shape[0]} but {ref_key!r} has "
                f"{ref_b}; all fields must share the first dimension"
            )


def _as_batched_tensordict(batch) -> TensorDict:
    """Accept a TensorDict (batch_size [B], or [] to be inferred) and return one with [B]."""
    if not isinstance(batch, TensorDict):
        raise ValueError(
            f"DataProto: batch must be a tensordict.TensorDict, got {type(batch).__name__}; "
            "use DataProto.from_dict(tensors=...) to build one from a dict of tensors"
        )
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"DataProto: batch field {key!r} is a {type(value).__name__}; DataProto keeps a flat "
                "TensorDict of tensors, so flatten nested keys (e.g. 'a.b') before building it"
            )
    if batch.batch_dims == 1:
        return batch
    if batch.batch_dims == 0:
        tensors = dict(batch.items())
        if not tensors:
            raise ValueError(
                "DataProto: an empty TensorDict with batch_size [] has no batch size; "
                "pass batch=None or give it batch_size=[B]"
            )
        _check_tensor_sizes(tensors)
        b = next(iter(tensors.values())).shape[0]
        return TensorDict(tensors, batch_size=[b], device=batch.device)
    raise ValueError(
        f"DataProto: batch has batch_size {list(batch.batch_size)}; it must be [B] (one batch "
        "dimension), with per-sample structure in the trailing tensor dims"
    )
