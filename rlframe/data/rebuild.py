"""Rebuild a pre-trained tiny model shipped in the repository (rlframe/data/presets/<name>/):

    python -m rlframe.data.rebuild demo

trains it on this machine (rlframe/data/pretrain.py, in a temporary cache), rewrites its files and
their sha256 sums (shipped.py's manifest) and says whether the weights changed. Above both
pretrain.py and shipped.py, which build and verify; neither imports this.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from rlframe.data import pretrain, shipped


def rebuild(name: str, presets_dir: Path | None = None) -> Path:
    """Train shipped model `name` on this machine (in a temporary cache) and write it, with its
    manifest, to `presets_dir/name` (the repository's rlframe/data/presets by default)."""
    if name not in shipped.RECIPES:
        raise ValueError(f"no shipped model {name!r}; choose one of {sorted(shipped.RECIPES)}")
    recipe = shipped.RECIPES[name]
    key = pretrain.cache_key(**recipe, cfg=pretrain.default_sft(recipe["task"]))
    out = Path(presets_dir or shipped.PRESETS_DIR) / name
    with tempfile.TemporaryDirectory() as cache:
        built = pretrain.build_pretrained_model(**recipe, cache_dir=cache, use_shipped=False)
        files = sorted(p.name for p in built.iterdir() if p.is_file())
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for f in files:
            shutil.copyfile(built / f, out / f)
    manifest = {"name": name, "cache_key": key, "sha256": {f: shipped.sha256_file(out / f) for f in files}}
    (out / shipped.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m rlframe.data.rebuild",
                                description="Rebuild a pre-trained tiny model shipped in rlframe/data/presets/ "
                                            "(trains it on this machine and rewrites its files and sha256 sums).")
    p.add_argument("name", choices=sorted(shipped.RECIPES))
    name = p.parse_args(argv).name
    old = shipped.PRESETS_DIR / name / shipped.MANIFEST
    before = shipped.read_manifest(old.parent)["sha256"].get("model.safetensors") if old.is_file() else None
    out = rebuild(name)
    after = shipped.read_manifest(out)["sha256"]["model.safetensors"]
    change = "unchanged" if after == before else f"changed (was {before})" if before else "new"
    print(f"rebuilt {out}: model.safetensors sha256 {after}, {change}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
