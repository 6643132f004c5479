"""Which weight files a model directory from someone else may be loaded from.

Models come in through `model.path`, `model.critic_path` and `reward.model_paths`. rlframe reads
their weights from safetensors (a flat tensor format: loading it cannot run code). Weights only in a
pickle-based format (`pytorch_model.bin`, `*.pt`, `*.pth`, `*.ckpt`, `*.pkl`) are refused unless the
user sets `model.allow_pickle_weights=true`: unpickling a file can run arbitrary code written into it.
"""

from __future__ import annotations

from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_NOT_WEIGHTS = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth")  # trainer leftovers


def pickle_only_weights(model_dir: str | Path) -> list[str]:
    """Names of the pickle weight files of `model_dir` when it has no safetensors weights; [] otherwise
    (also for a directory that does not exist: other checks report that)."""
    d = Path(model_dir).expanduser()
    if not d.is_dir() or any(d.glob("*.safetensors")):
        return []
    return sorted(p.name for p in d.iterdir()
                  if p.is_file() and p.suffix in PICKLE_SUFFIXES and p.name not in _NOT_WEIGHTS)


def check_weight_format(key: str, model_dir: str | Path, *, allow_pickle: bool) -> str | None:
    """A problem (what, why, how to fix) when `model_dir` (the config key `key`) has pickle weights
    only and the user has not opted in; None when it may be loaded."""
    found = pickle_only_weights(model_dir)
    if not found or allow_pickle:
        return None
    return (f"{key}={str(model_dir)!r} has weights only in pickle format ({', '.join(found[:3])}"
            f"{', ...' if len(found) > 3 else ''}) and no *.safetensors: loading a pickle can run arbitrary code "
            "written into the file, so rlframe loads safetensors only. Convert it once, where you trust its source "
            "(AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst, safe_serialization=True)), or set "
            "model.allow_pickle_weights=true to load it as it is")
