"""Atomic sharded checkpoints (torch.distributed.checkpoint) and full HF export.

Layout of a checkpoint directory:
  model_optim/      DCP shards of the model and optimizer state (each rank writes its own shards;
                    DCP records global offsets, so they describe themselves); the megatron engine
                    writes its own per-rank files instead (see engines/megatron/checkpoint.py)
  engine_state.pt   scheduler state, optimizer step count, torch RNG state of rank 0
  layout.json       dp, tp, head and model path of the engine that wrote it
Atomicity: all ranks write into `<path>.tmp`; after a barrier rank 0 renames it to `<path>`
(replacing an older checkpoint only after the new one is complete), so a crash never leaves a
half-written directory under the final name.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rlframe.workers.engines.modeling import copy_tokenizer_files, save_full_model


def save_atomically(engine, path: str, *, barrier, write_state) -> None:
    """The atomic skeleton every backend shares: `write_state(tmp_dir)` runs on every rank (it writes
    the model and optimizer shards), rank 0 adds engine_state.pt and layout.json, then renames."""
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    if engine.is_first_rank and os.path.exists(tmp):
        shutil.rmtree(tmp)
    barrier()
    write_state(tmp)
    if engine.is_first_rank:
        torch.save({**engine.engine_state(), "rng": torch.get_rng_state()}, os.path.join(tmp, "engine_state.pt"))
        with open(os.path.join(tmp, "layout.json"), "w") as f:
            json.dump(engine.layout_meta(), f, indent=1)
    barrier()
    if engine.is_first_rank:
        old = path + ".old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    barrier()


def check_checkpoint(engine, path: str) -> str:
    """`path` as an absolute checkpoint directory of a model with this engine's head."""
    path = os.path.abspath(path)
    layout_file = os.path.join(path, "layout.json")
    if not os.path.isfile(layout_file):
        raise ValueError(f"{path!r} is not an engine checkpoint (no layout.json); pass a directory save_checkpoint wrote")
    with open(layout_file) as f:
        saved = json.load(f)
    mine = engine.layout_meta()
    if saved["head"] != mine["head"]:
        raise ValueError(f"checkpoint {path!r} holds a {saved['head']!r} model, this engine is {mine['head']!r}")
    return path


def load_engine_state(engine, path: str) -> None:
    extra = torch.load(os.path.join(path, "engine_state.pt"), weights_only=False)
    engine.load_engine_state(extra)
    torch.set_rng_state(extra["rng"])


def save_checkpoint(engine, path: str, *, barrier, process_group) -> None:
    """DCP shards of the model and optimizer (FSDP2 / DTensor engines)."""

    def write_state(tmp):
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "model_optim"),
                 process_group=process_group)

    save_atomically(engine, path, barrier=barrier, write_state=write_state)


def load_checkpoint(engine, path: str, *, process_group) -> None:
    path = check_checkpoint(engine, path)
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(path, "model_optim"), process_group=process_group)
    set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    load_engine_state(engine, path)


def gather_full_state(model) -> dict[str, torch.Tensor]:
    """Full HF-named tensors on every rank (all-gathers each DTensor; fine for small models)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach().to("cpu", copy=True)
    return out


def export_hf(engine, path: str, *, full: dict[str, torch.Tensor], hf_config, barrier) -> None:
    """Rank 0 writes `full` (HF names) as a `from_pretrained`-loadable checkpoint (+ tokenizer) at
    `path`, atomically."""
    path = os.path.abspath(path)
    if engine.is_first_rank:
        tmp = path + ".tmp"
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        hf_config = copy.deepcopy(hf_config)
        hf_config.use_cache = True
        save_full_model(full, hf_config=hf_config, head=engine.config.head, out_dir=tmp)
        copy_tokenizer_files(engine.config.model_path, tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    barrier()

