"""Export a training checkpoint to a Hugging Face model directory (what verl's model_merger does).

    rlframe export CHECKPOINT_DIR OUT_DIR [--role actor] [--merge-lora] [--model-path DIR] [--overwrite]

CHECKPOINT_DIR is a run checkpoint (`outputs/<experiment>/checkpoints/step_NNNNNN`, whose `--role`
directory is exported) or one engine checkpoint directory (the one holding `layout.json`). The
export runs in this one process on CPU, without Ray or a process group, and reads the shards
directly, whatever layout wrote them:

- fsdp (`model_optim/`, DCP shards at any dp/tp): the model's tensors are read whole from the DCP
  metadata's global shapes through `dcp_reader` (no unpickling of code, no optimizer state read);
- megatron (`mp_TT_PPP/model.pt` at any tp/pp): each (tp, pp) file is converted to HF names
  (`resharding.formats.megatron_to_hf`) and placed at its box of the global tensor (`Layout.box`);
- LoRA (fsdp with `lora` in layout.json): the checkpoint holds only the adapters; the base is the
  model at `model_path`. Without `--merge-lora` OUT_DIR is PEFT's adapter directory
  (`adapter_model.safetensors` + `adapter_config.json`), with it the merged model.

Before anything is read the checkpoint is verified against its manifest (the check resume and every
engine load make); a damaged one is refused naming each damaged file. The output is `config.json`
(the run's model config), `model.safetensors`, `generation_config.json` and the tokenizer of the
run's model (`model_path` in layout.json, or `--model-path` when the model moved), written into
`OUT_DIR.tmp` and renamed, so OUT_DIR is complete or absent. It loads in transformers and vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from rlframe.plugins import engine_spec
from rlframe.utils import manifest
from rlframe.workers.engines.export_error import ExportError

LAYOUT_FILE = "layout.json"
RUN_STATE_FILE = "trainer_state.json"




@dataclass(frozen=True)
class EngineCheckpoint:
    path: Path  # the engine directory (holds layout.json)
    layout: dict
    model_path: str  # the base/run model: config, tokenizer, and a LoRA checkpoint's frozen weights

    @property
    def backend(self) -> str:
        return self.layout.get("backend", "fsdp")

    @property
    def head(self) -> str:
        return self.layout.get("head", "lm")

    @property
    def lora(self) -> dict | None:
        return self.layout.get("lora")


def find_engine_dir(checkpoint_dir: str | os.PathLike, *, role: str = "actor") -> Path:
    """The engine checkpoint directory of `role` in a run checkpoint, or `checkpoint_dir` itself when
    it is an engine checkpoint."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise ExportError(f"{str(root)!r} is not a directory; pass a run checkpoint "
                          "(outputs/<experiment>/checkpoints/step_NNNNNN) or one of its role directories")
    if (root / LAYOUT_FILE).is_file():
        return root
    if (root / role / LAYOUT_FILE).is_file():
        return root / role
    roles = sorted(p.name for p in root.iterdir() if (p / LAYOUT_FILE).is_file())
    if roles:
        raise ExportError(f"{str(root)!r} has no {role!r} engine checkpoint; its roles are {roles} (pass --role)")
    hint = (" (it looks like a run directory: pass one of its checkpoints/step_NNNNNN)"
            if (root / "checkpoints").is_dir() else "")
    raise ExportError(f"{str(root)!r} is not a checkpoint: neither it nor {str(root / role)!r} holds "
                      f"{LAYOUT_FILE}{hint}")


def open_checkpoint(checkpoint_dir: str | os.PathLike, *, role: str = "actor",
                    model_path: str | None = None) -> EngineCheckpoint:
    """Find, verify (manifest: sizes and sha256 of every file) and describe an engine checkpoint."""
    path = find_engine_dir(checkpoint_dir, role=role).resolve()
    try:
        manifest.verify(path)
    except manifest.CheckpointDamaged as err:
        raise ExportError(f"refusing to export a damaged checkpoint: {err}. Export another checkpoint "
                          "(an earlier step_NNNNNN) or restore the damaged files") from None
    with open(path / LAYOUT_FILE) as f:
        layout = json.load(f)
    base = model_path or layout.get("model_path")
    if not base or not os.path.isfile(os.path.join(base, "config.json")):
        raise ExportError(
            f"the model the checkpoint was trained from, {base!r} (model_path in {path / LAYOUT_FILE}), has no "
            "config.json: the checkpoint holds the weights but not the model's config and tokenizer"
            + (" nor, with LoRA, the frozen base weights" if layout.get("lora") else "")
            + "; pass --model-path DIR pointing at that model")
    if layout.get("lora") and model_path and os.path.realpath(model_path) != os.path.realpath(
            layout.get("model_path", "")):
        warnings.warn(f"LoRA adapters of {layout.get('model_path')!r} are merged into {model_path!r} (--model-path): "
                      "they are only meaningful on the base model they were trained on", stacklevel=2)
    return EngineCheckpoint(path=path, layout=layout, model_path=str(base))


# ---------------------------------------------------------------- reading the weights
def read_base_model(model_path: str) -> dict[str, torch.Tensor]:
    from rlframe.workers.engines.hf_weights import read_whole

    return read_whole(model_path)


# ---------------------------------------------------------------- writing
def _tokenizer_files(model_path: str, out_dir: str) -> None:
    from rlframe.workers.engines.fsdp.modeling import copy_tokenizer_files

    copy_tokenizer_files(model_path, out_dir)
    gen = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen) and not os.path.exists(os.path.join(out_dir, "generation_config.json")):
        shutil.copy2(gen, out_dir)


def _write_model(full: dict[str, torch.Tensor], *, hf_config, head: str, out_dir: str) -> None:
    import copy

    from rlframe.workers.engines.fsdp.modeling import save_full_model

    hf_config = copy.deepcopy(hf_config)
    hf_config.use_cache = True
    try:
        save_full_model(full, hf_config=hf_config, head=head, out_dir=out_dir)
    except RuntimeError as err:  # load_state_dict(strict=True): names or shapes differ from the config
        raise ExportError(f"the checkpoint's weights do not fit the config of the model at model_path: {err}") from None


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, role: str = "actor",
                      merge_lora: bool = False, model_path: str | None = None, overwrite: bool = False) -> dict:
    """Write the checkpoint's model to `out_dir` as an HF directory (a LoRA checkpoint: PEFT's adapter
    directory, or with `merge_lora` the merged model). Returns a summary (what was written, from where)."""
    from transformers import AutoConfig

    from rlframe.workers.engines import lora as lora_mod

    ck = open_checkpoint(checkpoint_dir, role=role, model_path=model_path)
    out = Path(out_dir).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ExportError(f"{str(out)!r} exists and is not empty; choose another OUT_DIR or pass --overwrite")
    if out == ck.path or ck.path in out.parents:
        raise ExportError(f"OUT_DIR {str(out)!r} is inside the checkpoint {str(ck.path)!r}; export elsewhere")
    if merge_lora and not ck.lora:
        raise ExportError(f"--merge-lora: {ck.path} is not a LoRA checkpoint (layout.json has no lora settings)")
    hf_config = AutoConfig.from_pretrained(ck.model_path)

    try:
        spec = engine_spec(ck.backend)
    except ValueError as err:
        raise ExportError(f"{ck.path}: layout.json names the engine {ck.backend!r}: {err}") from None
    if spec.read_checkpoint is None:
        raise ExportError(f"{ck.path}: the {ck.backend} engine has no checkpoint reader (its spec's read_checkpoint)")
    weights = spec.read_checkpoint(ck.path, ck.layout, hf_config)

    tmp = out.parent / (out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    kind = "model"
    try:
        if ck.lora:
            settings = lora_mod.LoraSettings(rank=int(ck.lora["rank"]), alpha=float(ck.lora["alpha"]),
                                             target_modules=tuple(ck.lora["target_modules"]),
                                             dropout=float(ck.lora.get("dropout", 0.0)))
            stray = sorted(k for k in weights if not lora_mod.is_adapter_name(k) and not k.startswith("score."))
            if stray:
                raise ExportError(f"{ck.path}: a LoRA checkpoint should hold only adapters, it holds {stray[:3]}")
            if merge_lora:
                full = {**read_base_model(ck.model_path), **weights}
                _write_model(lora_mod.merge_state_dict(full, settings), hf_config=hf_config, head=ck.head,
                             out_dir=str(tmp))
                kind = "merged LoRA model"
            else:
                lora_mod.write_peft_adapter(str(tmp), weights, settings, base_model_path=ck.model_path, head=ck.head)
                kind = "PEFT adapter"
        else:
            _write_model(weights, hf_config=hf_config, head=ck.head, out_dir=str(tmp))
        _tokenizer_files(ck.model_path, str(tmp))
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out_dir": str(out), "checkpoint": str(ck.path), "kind": kind, "backend": ck.backend,
            "layout": {k: ck.layout.get(k) for k in ("dp", "tp", "pp") if k in ck.layout},
            "model_path": ck.model_path, "tensors": len(weights)}
