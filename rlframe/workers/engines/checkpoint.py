"""Atomic, verified sharded checkpoints (torch.distributed.checkpoint) and full HF export.

Layout of a checkpoint directory:
  model_optim/      DCP shards of the model and optimizer state (each rank writes its own shards;
                    DCP records global offsets, so they describe themselves); the megatron engine
                    writes its own per-rank files instead (see engines/megatron/checkpoint.py)
  engine_state.pt   scheduler state, optimizer step count
  rng/rank_NNNNN.pt every rank's own RNG states (torch CPU, CUDA where used, numpy, python, and the
                    engine's own generators such as megatron-core's model-parallel tracker); each
                    rank gets its own back on load (a rank whose file is missing, after the number
                    of ranks grew, keeps its seeded state and says so)
  layout.json       dp, tp, head and model path of the engine that wrote it, and its LoRA settings
                    (null without LoRA). A LoRA engine's model_optim/ holds only the trainable
                    parameters (adapters, a critic's value head) and their optimizer state: the
                    frozen base is the model at model_path, so loading needs the same model_path
                    and LoRA settings.
  MANIFEST.json     size and sha256 of every other file (rlframe/utils/manifest.py), written last
Atomicity: all ranks write into `<path>.tmp`; after a barrier the ranks hash the files (each a
share), rank 0 writes the manifest and renames the directory to `<path>` (replacing an older
checkpoint only after the new one is complete), so a crash never leaves a half-written directory
under the final name.
Loading verifies the manifest first (each rank a share of the files; every rank raises the same
error naming each damaged file), then reads only with `torch.load(weights_only=True)` or DCP through
`dcp_reader` (no pickle that could run code; docs/checkpoints.md).
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rlframe.utils import manifest
from rlframe.workers.engines.dcp_reader import SafeFileSystemReader, SafeLoadPlanner, load_weights_only
from rlframe.workers.engines.fsdp.modeling import copy_tokenizer_files, save_full_model

_TRUE = ("1", "y", "yes", "true")
ADAPTER_DIR = "adapter"  # PEFT adapter directory inside a LoRA engine's HF export


def _rank_world(group) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)


def _all_gather(obj, group) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _my_share(files: dict[str, int], group) -> list[str]:
    """This rank's files to hash: largest first to the least loaded rank (the same on every rank)."""
    me, world = _rank_world(group)
    load, mine = [0] * world, []
    for name, size in sorted(files.items(), key=lambda kv: (-kv[1], kv[0])):
        r = load.index(min(load))
        load[r] += size
        if r == me:
            mine.append(name)
    return mine


def _write_manifest_collectively(tmp: str, *, is_first: bool, group) -> None:
    names = manifest.list_files(tmp)
    sizes = {n: os.path.getsize(os.path.join(tmp, n)) for n in names}
    hashed = {}
    for part in _all_gather(manifest.hash_files(tmp, _my_share(sizes, group)), group):
        hashed.update(part)
    if is_first:
        manifest.write_manifest(tmp, entries=hashed)


def verify_collectively(path: str, *, group=None) -> None:
    """Every rank of `group` checks a share of `path`'s files against its manifest; all raise the same
    CheckpointDamaged naming every damaged file, or all return."""
    try:
        entries = manifest.read_manifest(path)
        problems = manifest.unlisted_files(path, entries) if _rank_world(group)[0] == 0 else []
        share = set(_my_share({n: e["size"] for n, e in entries.items()}, group))
        problems += manifest.check_files(path, {n: e for n, e in entries.items() if n in share})
    except manifest.CheckpointDamaged as err:
        problems = err.problems
    merged = list(dict.fromkeys(p for part in _all_gather(problems, group) for p in part))
    if merged:
        raise manifest.CheckpointDamaged(path, merged)


class SharedStorageError(RuntimeError):
    pass


_PROBE = ".shared-storage-probe"


def check_shared_storage(tmp: str, *, is_first: bool, group) -> None:
    """Every rank of `group` must see the files the first rank writes under `tmp`: a checkpoint is
    one directory the ranks fill together and one rank hashes and renames, so it needs storage shared
    by all nodes (NFS, Lustre, a mounted bucket). All ranks raise the same error otherwise, naming
    the hosts that could not see it, and the first rank removes what it wrote."""
    import socket
    import uuid

    token = None
    if is_first:
        os.makedirs(tmp, exist_ok=True)
        token = uuid.uuid4().hex
        with open(os.path.join(tmp, _PROBE), "w") as f:
            f.write(token)
    token = next(t for t in _all_gather(token, group) if t is not None)
    try:
        with open(os.path.join(tmp, _PROBE)) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    views = _all_gather((_rank_world(group)[0], socket.gethostname(), seen), group)
    blind = [(rank, host) for rank, host, ok in views if not ok]
    if is_first:
        os.remove(os.path.join(tmp, _PROBE))
        if blind:
            shutil.rmtree(tmp, ignore_errors=True)
    _all_gather(None, group)  # every rank returns after the probe (or the refused directory) is gone
    if blind:
        raise SharedStorageError(
            f"checkpoint directory {os.path.dirname(tmp)!r} is not on storage shared by all ranks: ranks "
            f"{[r for r, _ in blind]} on hosts {sorted({h for _, h in blind})} do not see the file the first rank "
            "wrote there. Set trainer.output_dir to a filesystem every node mounts at the same path "
            "(docs/checkpoints.md)")


RNG_DIR = "rng"


def _rng_file(root: str, rank: int) -> str:
    return os.path.join(root, RNG_DIR, f"rank_{rank:05d}.pt")


def rank_rng_state(engine) -> dict:
    """This rank's RNG states as tensors and plain values (loadable with weights_only=True)."""
    import random

    import numpy as np

    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                       "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
             "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64),
                        "gauss_next": py_gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    extra = getattr(engine, "extra_rng_state", None)
    if extra is not None:
        state["engine"] = extra()
    return state


def restore_rank_rng(engine, state: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    if "python" in state:
        py = state["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "engine" in state and getattr(engine, "load_extra_rng_state", None) is not None:
        engine.load_extra_rng_state(state["engine"])


def save_atomically(engine, path: str, *, barrier, write_state, group=None) -> None:
    """The atomic skeleton every backend shares: `write_state(tmp_dir)` runs on every rank (it writes
    the model and optimizer shards), rank 0 adds engine_state.pt and layout.json, the ranks of `group`
    (the engine's ranks; None: all) hash the files, rank 0 writes the manifest and renames."""
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    if engine.is_first_rank and os.path.exists(tmp):
        shutil.rmtree(tmp)
    barrier()
    check_shared_storage(tmp, is_first=engine.is_first_rank, group=group)
    write_state(tmp)
    rank = _rank_world(group)[0]
    os.makedirs(os.path.join(tmp, RNG_DIR), exist_ok=True)
    torch.save(rank_rng_state(engine), _rng_file(tmp, rank))  # every rank its own
    if engine.is_first_rank:
        torch.save(engine.engine_state(), os.path.join(tmp, "engine_state.pt"))
        with open(os.path.join(tmp, "layout.json"), "w") as f:
            json.dump(engine.layout_meta(), f, indent=1)
    barrier()
    _write_manifest_collectively(tmp, is_first=engine.is_first_rank, group=group)
    barrier()
    if engine.is_first_rank:
        old = path + ".old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    barrier()


def _refuse_unsafe_torch_load_env() -> None:
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        raise ValueError(
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set in this worker's environment: torch.load calls that do not "
            "pass weights_only (megatron-core's parameter-state loader) would unpickle arbitrary objects, and a "
            "crafted checkpoint could run code. Unset it for rlframe runs")


def check_checkpoint(engine, path: str, *, group=None) -> str:
    """`path` as an absolute checkpoint directory of a model with this engine's head, verified against
    its manifest by the ranks of `group` (the engine's ranks; None: all) before anything is loaded."""
    path = os.path.abspath(path)
    layout_file = os.path.join(path, "layout.json")
    if not os.path.isfile(layout_file):
        raise ValueError(f"{path!r} is not an engine checkpoint (no layout.json); pass a directory save_checkpoint wrote")
    _refuse_unsafe_torch_load_env()
    verify_collectively(path, group=group)
    with open(layout_file) as f:
        saved = json.load(f)
    mine = engine.layout_meta()
    if saved["head"] != mine["head"]:
        raise ValueError(f"checkpoint {path!r} holds a {saved['head']!r} model, this engine is {mine['head']!r}")
    _check_lora_meta(path, saved, mine)
    return path


def _check_lora_meta(path: str, saved: dict, mine: dict) -> None:
    """A LoRA checkpoint holds adapters for one base model and LoRA shape; refuse any other engine."""
    theirs, ours = saved.get("lora"), mine.get("lora")
    if theirs is None and ours is None:
        return
    if theirs is None or ours is None:
        raise ValueError(
            f"checkpoint {path!r} was written {'with' if theirs else 'without'} LoRA (lora={theirs}), this engine "
            f"is {'with' if ours else 'without'} LoRA (lora={ours}); set lora_rank (and the other lora_* "
            "settings) as in the run that wrote it")
    if theirs != ours:
        diff = {k: (theirs.get(k), ours.get(k)) for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)}
        raise ValueError(
            f"checkpoint {path!r} holds LoRA adapters of other settings: (checkpoint, engine) = {diff}; set the "
            "lora_* settings as in the run that wrote it")
    if os.path.realpath(saved.get("model_path", "")) != os.path.realpath(mine["model_path"]):
        raise ValueError(
            f"checkpoint {path!r} holds LoRA adapters of the base model {saved.get('model_path')!r}, but this "
            f"engine's base model is {mine['model_path']!r}; the base is not in the checkpoint, so point "
            "model_path at the model the adapters were trained on")


def _state_dict_options(engine):
    """A LoRA engine saves and loads only its trainable parameters (the base is at model_path)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = getattr(engine, "lora", None) is not None
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def load_tensors(file: str, *, map_location=None):
    """A torch.save'd file of tensors and plain containers; never unpickles anything else."""
    return load_weights_only(file, what=file, map_location=map_location)


def load_engine_state(engine, path: str, *, group=None) -> None:
    """The engine's state (scheduler, step count), then this rank's own RNG states. A checkpoint of an
    older version holds only rank 0's torch state, in engine_state.pt: every rank gets that one."""
    extra = load_tensors(os.path.join(path, "engine_state.pt"))
    engine.load_engine_state(extra)
    rank = _rank_world(group)[0]
    mine = _rng_file(path, rank)
    if os.path.isfile(mine):
        restore_rank_rng(engine, load_tensors(mine))
    elif "rng" in extra:
        torch.set_rng_state(extra["rng"])
    elif os.path.isdir(os.path.join(path, RNG_DIR)):
        import warnings

        warnings.warn(f"{path}: no RNG state for rank {rank} (written by fewer ranks); this rank keeps its "
                      "seeded RNG state", stacklevel=2)


def save_checkpoint(engine, path: str, *, barrier, process_group) -> None:
    """DCP shards of the model and optimizer (FSDP2 / DTensor engines)."""

    def write_state(tmp):
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=_state_dict_options(engine))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "model_optim"),
                 process_group=process_group)

    save_atomically(engine, path, barrier=barrier, write_state=write_state, group=process_group)


def load_checkpoint(engine, path: str, *, process_group) -> None:
    path = check_checkpoint(engine, path, group=process_group)
    options = _state_dict_options(engine)
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    reader = SafeFileSystemReader(os.path.join(path, "model_optim"))
    reader.read_metadata()  # a refused pickle fails here, with its own message (DCP would wrap it)
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group)
    set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)
    load_engine_state(engine, path, group=process_group)


def gather_full_state(model, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """Full HF-named tensors, in host memory, on the ranks with `keep` (an empty dict on the others).
    Collective over the model's mesh: every rank all-gathers each DTensor in turn, and a rank that
    does not keep it drops the gathered copy before the next one, so it never holds more than one
    full tensor (`export_hf` keeps them on the writing rank alone)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out


def export_hf(engine, path: str, *, full: dict[str, torch.Tensor], hf_config, barrier, write_extra=None) -> None:
    """Rank 0 writes `full` (HF names) as a `from_pretrained`-loadable checkpoint (+ tokenizer) at
    `path`, atomically; `write_extra(dir)` adds more files (a LoRA engine's adapter) before the rename."""
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
        if write_extra is not None:
            write_extra(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    barrier()

