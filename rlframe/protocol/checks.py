"""Checks and comparisons behind DataProto's error messages (every one names the key and sizes)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch


def non_tensor_array(key: str, value) -> np.ndarray:
    """A per-sample field as a 1-D numpy array: lists become object arrays element by element
    (np.array would turn a list of equal-length lists into a 2-D array)."""
    if isinstance(value, torch.Tensor):
        raise ValueError(
            f"DataProto: non-tensor {key!r} is a torch.Tensor; pass it under tensors instead"
        )
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(
                f"DataProto: non-tensor {key!r} has shape {value.shape}; non-tensor fields are 1-D "
                "(one Python object per sample): use a tensor, or an object array of per-sample arrays"
            )
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(
            f"DataProto: non-tensor {key!r} must be a list or 1-D numpy array with one entry per "
            f"sample, got {type(value).__name__}; put per-batch values in meta_info"
        )
    arr = np.empty(len(value), dtype=object)
    for i, item in enumerate(value):
        arr[i] = item
    return arr


def check_keys_exist(op: str, kind: str, keys: list[str], available: list[str]) -> None:
    """KeyError that lists the available keys when any of `keys` is missing."""
    missing = [k for k in keys if k not in available]
    if missing:
        raise KeyError(
            f"DataProto.{op}: {kind} key(s) {missing} not found; available {kind} keys: {available}"
        )


def check_index(i: int, n: int) -> int:
    """A valid non-negative row index, or IndexError naming the index and the batch size."""
    if not -n <= i < n:
        raise IndexError(f"DataProto: index {i} is out of range for batch size {n}")
    return i % n


def check_mask_length(mask: np.ndarray, n: int) -> None:
    if mask.ndim != 1 or mask.shape[0] != n:
        raise ValueError(
            f"DataProto: bool mask has shape {mask.shape} but the batch size is {n}; "
            "a mask needs exactly one entry per sample"
        )


def values_equal(a: Any, b: Any) -> bool:
    """Exact equality for the values DataProto holds: tensors, numpy arrays (object arrays
    elementwise), containers, and scalars (NaN equals NaN, so a batch equals its own copy)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(values_equal, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a bool (or raises) count as different
        return False


def merge_meta(op: str, metas: list[dict[str, Any]], *, require_same_keys: bool) -> dict[str, Any]:
    """One meta_info from several; a key with different values (or missing from a part, when
    `require_same_keys`) is a ValueError naming the key."""
    hint = "; or list it in gather_meta_keys to keep one value per part" if op == "concat" else ""
    merged: dict[str, Any] = {}
    for i, meta in enumerate(metas):
        if require_same_keys and i > 0 and set(meta) != set(metas[0]):
            diff = sorted(set(meta) ^ set(metas[0]))
            raise ValueError(
                f"DataProto.{op}: meta_info key(s) {diff} are in some parts but not others "
                f"(part 0 has {sorted(metas[0])}, part {i} has {sorted(meta)}); "
                f"every part must carry the same meta_info{hint}"
            )
        for key, value in meta.items():
            if key in merged and not values_equal(merged[key], value):
                raise ValueError(
                    f"DataProto.{op}: meta_info {key!r} differs between parts "
                    f"({merged[key]!r} vs {value!r}); make them agree or pop the key first{hint}"
                )
            merged.setdefault(key, value)
    return merged
