"""Pre-trained tiny models shipped in the repository, so that every machine starts from the same bits.

The pinned pre-training (rlframe/data/pretrain.py) still built different weights on AMD and on Intel
machines (docs/tiny_model.md), and it took most of the first run's start-up. So the model the default
configs start from is built once and kept in `rlframe/data/presets/<name>/`: the files
`build_pretrained_model` writes (config, tokenizer, `model.safetensors`, `rlframe_pretrain.json`, which
records the machine that built it) and `shipped.json`: the recipe's cache key and the sha256 of every
file. `build_pretrained_model` takes the shipped folder whenever its recipe has that cache key: the
files are verified and copied into the cache (`models/<key>-shipped/`), and no training runs. A file
whose sha256 differs is refused. Any other recipe (other steps, seed, task spec or format version) is
built as before.

Rebuild (after a change of the recipe, torch or transformers): `python -m rlframe.data.rebuild demo`
(rlframe/data/rebuild.py) trains the model on this machine and rewrites the folder and its sums.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
MANIFEST = "shipped.json"

# Shipped models by name: the arguments of build_pretrained_model (the default SFT recipe of the task).
RECIPES: dict[str, dict] = {
    "demo": {"preset": "demo", "task": "arithmetic", "seed": 0},  # configs/ppo_tiny.yaml and those built on it
    "agent": {"preset": "agent", "task": "tool_arithmetic", "seed": 0},  # agent.enabled runs (docs/agents.md)
    "series": {"preset": "demo", "task": "series", "seed": 0},  # configs/grpo_series.yaml (docs/async.md)
}


class ShippedModelError(RuntimeError):
    """A shipped model's file is missing or does not have the sha256 its manifest records."""


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / MANIFEST).read_text())


def find_shipped(key: str, presets_dir: Path | None = None) -> Path | None:
    """The shipped folder whose manifest records cache key `key`, or None."""
    root = Path(presets_dir or PRESETS_DIR)
    for folder in sorted(root.glob(f"*/{MANIFEST}")):
        try:
            if read_manifest(folder.parent).get("cache_key") == key:
                return folder.parent
        except (OSError, ValueError) as err:
            raise ShippedModelError(f"shipped model manifest {folder} cannot be read ({err}); restore it with "
                                    f"`git checkout -- {folder.parent}` or reinstall rlframe") from err
    return None


def mismatched_files(folder: Path, sums: dict[str, str]) -> list[str]:
    """Names in `sums` that are missing from `folder` or have another sha256."""
    bad = []
    for name, digest in sums.items():
        path = Path(folder) / name
        if not path.is_file() or sha256_file(path) != digest:
            bad.append(name)
    return bad


def verify_shipped(folder: Path) -> dict[str, str]:
    """The manifest's sums, after checking every file of `folder` against them (ShippedModelError if not)."""
    sums = read_manifest(folder)["sha256"]
    bad = mismatched_files(folder, sums)
    if bad:
        raise ShippedModelError(
            f"shipped pre-trained model {folder}: {', '.join(bad)} missing or not the file its {MANIFEST} records "
            "(sha256 differs), so it was damaged or edited and cannot be the model every machine starts from. "
            f"Restore it (`git checkout -- {folder}` or reinstall rlframe), or, if the recipe changed on "
            f"purpose, rebuild it with `python -m rlframe.data.rebuild {folder.name}`")
    return sums


def install_shipped(folder: Path, dest: Path) -> Path:
    """Verify the shipped `folder` and return `dest`, its copy in the cache (copied again if it differs)."""
    sums = verify_shipped(folder)
    if dest.is_dir() and not mismatched_files(dest, sums):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for name in sums:
            shutil.copyfile(folder / name, tmp / name)
        if dest.exists():  # a damaged copy: moved aside, then deleted
            stale = dest.parent / f".{dest.name}.stale.{os.getpid()}"
            os.rename(dest, stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process put its copy in place first: use it if it is right
            if mismatched_files(dest, sums):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
