"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP unpickles by design in two places: the `.metadata` file (a plain `pickle.dump` of its Metadata
dataclasses) and every non-tensor item (optimizer hyper-parameters and the like, `torch.load` with
weights_only=False in the default load planner). Here:
- `SafeFileSystemReader` reads `.metadata` with an unpickler that resolves only the classes DCP's
  metadata is made of (its metadata dataclasses, torch.Size, dtypes, layouts, paths); any other
  global is refused with an error that names it, so a crafted file cannot call anything;
- `SafeLoadPlanner` loads non-tensor items with `torch.load(weights_only=True)`.
Tensor data itself is read by DCP with weights_only=True already. Callers verify the checkpoint's
manifest before any of this runs (engines/checkpoint.py).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}


def load_weights_only(source, *, what: str, map_location=None) -> Any:
    """`torch.load(source, weights_only=True)`; a file holding anything else (a pickle that could run
    code) raises ValueError naming `what` instead of being unpickled."""
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message starts with advice to retry with weights_only=False: keep only the reason
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[-1] if lines else "")
        raise ValueError(
            f"{what} holds Python objects that torch.load(weights_only=True) refuses ({reason}). rlframe "
            "never unpickles arbitrary objects from a checkpoint, since a crafted file would run code when "
            "loaded. Use a checkpoint written by rlframe; a custom engine_state() must hold only tensors, "
            "numbers, strings, lists, tuples and dicts") from None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, *, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == _METADATA_MODULE:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == _METADATA_MODULE:
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ValueError(
            f"{self.where} refers to {module}.{name}, which is not part of torch.distributed.checkpoint's "
            "metadata; rlframe refuses to unpickle it because it could run code. This file was not written "
            "by rlframe's engines (or by a torch whose DCP format differs): re-save the checkpoint with "
            "this version, or start from an HF (safetensors) export instead")


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader whose `.metadata` is unpickled with an allow-list of DCP's own classes."""

    def read_metadata(self, *args: Any) -> Metadata:
        # No **kwargs: DCP then does not retry with per-rank metadata files (rlframe writes one global
        # file), so a refused pickle is the error the load reports.
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, where=path).load()
            except (pickle.UnpicklingError, EOFError) as err:
                raise ValueError(f"{path} is not a readable DCP metadata file ({err})") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner with non-tensor items loaded by `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_weights_only(value, what=f"DCP item {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
