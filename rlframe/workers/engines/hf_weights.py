"""Reading the tensors of an HF model directory a slice at a time, for the training engines.

Each rank reads only the Box of each tensor it holds (safetensors' `get_slice` reads just those
bytes), one tensor after another, so loading never holds more than this rank's shards plus the
slice being read. Weights come from `model.safetensors` or its sharded index; a directory with only
pickle weights (`pytorch_model.bin`, sharded or not: allowed only by `model.allow_pickle_weights`,
rlframe/utils/model_files.py) is memory-mapped with `torch.load(mmap=True, weights_only=True)`,
so only the slices read are paged in.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from rlframe.resharding.box import Box

_LAYOUTS = (("model.safetensors.index.json", "model.safetensors"),
            ("pytorch_model.bin.index.json", "pytorch_model.bin"))


def weight_map(model_path: str) -> dict[str, str]:
    """HF tensor name -> the file that holds it (safetensors first, else pickle .bin)."""
    for index, single in _LAYOUTS:
        index, single = os.path.join(model_path, index), os.path.join(model_path, single)
        if os.path.isfile(index):
            with open(index) as f:
                return {n: os.path.join(model_path, fn) for n, fn in json.load(f)["weight_map"].items()}
        if os.path.isfile(single):
            with _open(single) as tensors:
                return {n: single for n in tensors.keys()}
    raise ValueError(f"{model_path!r} has no model.safetensors(.index.json) (nor pytorch_model.bin): the training "
                     "engines load weights from these files; save the model with save_pretrained()")


class _PickleFile:
    """A memory-mapped pickle state dict with safetensors' `keys`/`get_slice` interface."""

    def __init__(self, path: str):
        self.tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)

    def keys(self):
        return self.tensors.keys()

    def get_slice(self, name: str):
        return _Sliceable(self.tensors[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name].clone()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.tensors = None


class _Sliceable:
    def __init__(self, t: torch.Tensor):
        self.t = t

    def get_shape(self):
        return list(self.t.shape)

    def __getitem__(self, index):
        return self.t[index].clone()


def _open(path: str):
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        return safe_open(path, framework="pt")
    return _PickleFile(path)


def iter_slices(model_path: str, boxes: dict[str, tuple[tuple[int, ...], Box]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the Box of that tensor) for each named tensor the checkpoint has, one at a time, read
    without loading whole tensors. Names the checkpoint lacks are skipped (a critic started from a
    causal LM has no `score`); a tensor whose shape differs from the expected global shape is an error."""
    where = weight_map(model_path)
    by_file: dict[str, list[str]] = {}
    for name in boxes:
        if name in where:
            by_file.setdefault(where[name], []).append(name)
    for path, names in by_file.items():
        with _open(path) as f:
            for name in names:
                shape, box = boxes[name]
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != tuple(shape):
                    raise ValueError(f"{path}: {name} has shape {tuple(sl.get_shape())}, the config implies {shape}")
                if box.empty:  # an empty FSDP shard (dim 0 < dp): safetensors
                    yield name, torch.empty(box.sizes, dtype=torch.float32)  # refuses [n:n] at the end
                    continue
                yield name, sl[box.slices()]


def read_whole(model_path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, whole."""
    where = weight_map(model_path)
    out = {}
    for path in sorted(set(where.values())):
        with _open(path) as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out
