"""Reading an fsdp engine's checkpoint without a process group (`rlframe export`, the spec's read_checkpoint)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from rlframe.workers.engines.export_error import ExportError


def read_model(engine_dir: Path) -> dict[str, torch.Tensor]:
    """The model part of an fsdp engine's DCP checkpoint as whole, HF-named tensors (any dp/tp: DCP
    records every shard's global offsets), read in this process without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from rlframe.workers.engines.dcp_reader import SafeFileSystemReader, SafeLoadPlanner

    reader = SafeFileSystemReader(str(engine_dir / "model_optim"))
    metadata = reader.read_metadata()
    model = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[key[len("model."):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        raise ExportError(f"{engine_dir / 'model_optim'} holds no model tensors")
    state = {"model": model}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state["model"]
