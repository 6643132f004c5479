"""Checkpoint manifests: the size and sha256 of every file of a directory, checked before a load.

A checkpoint directory is complete and undamaged iff its `MANIFEST.json` (written last, before the
directory is renamed into place) lists exactly the files it holds, with their sizes and hashes.
That catches what the atomic rename cannot: a file truncated or changed after the rename (a full
disk, an interrupted copy, a bad node). It does not make a checkpoint from someone else safe: whoever
writes the files can write a matching manifest, which is why loading never unpickles code
(docs/checkpoints.md).

    write_manifest(dir)          # after every other file is written
    verify(dir)                  # CheckpointDamaged (a ValueError) naming each damaged file

A manifest of a directory that holds directories with manifests of their own (a run checkpoint
holding the engines' checkpoints) reuses their entries instead of hashing those files again.

Command line, for checkpoints written before manifests existed (only for files you trust):
    python -m rlframe.utils.manifest verify|write DIR
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "MANIFEST.json"
FORMAT = "rlframe-manifest/1"
_CHUNK = 4 << 20


class CheckpointDamaged(ValueError):
    """A checkpoint whose files do not match its manifest (or that has none)."""

    def __init__(self, path: str | Path, problems: list[str]):
        self.path, self.problems = str(path), problems
        super().__init__(
            f"checkpoint {self.path} failed verification: " + "; ".join(problems) +
            ". Its files are not what was written, so loading it could resume from wrong weights; use "
            "another checkpoint (trainer.resume=auto picks the newest one that verifies) or delete this one")


def list_files(root: str | Path) -> list[str]:
    """Every file under `root` as a sorted relative posix path, the top-level manifest excluded."""
    root = Path(root)
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def hash_file(path: str | Path) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def hash_files(root: str | Path, rels: list[str]) -> dict[str, dict]:
    """{rel: {size, sha256}}; files are hashed in threads (hashlib releases the GIL on large reads)."""
    root = Path(root)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(1, len(rels)))) as pool:
        return dict(zip(rels, pool.map(lambda r: hash_file(root / r), rels)))


def read_manifest(root: str | Path) -> dict[str, dict]:
    """The {rel: {size, sha256}} entries of `root`'s manifest (CheckpointDamaged if absent or unreadable)."""
    file = Path(root) / MANIFEST
    if not file.is_file():
        raise CheckpointDamaged(root, [f"it has no {MANIFEST} (it was not finished, or was written before "
                                       "rlframe wrote manifests; if you trust it, run `python -m "
                                       f"rlframe.utils.manifest write {root}` once)"])
    try:
        data = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError):
        data = None
    files = data.get("files") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            and not rel.startswith("/") and ".." not in rel.split("/") for rel, e in files.items()):
        raise CheckpointDamaged(root, [f"{MANIFEST} is not a readable {FORMAT} manifest"])
    return files


def _entries_reusing_nested(root: Path, rels: list[str]) -> dict[str, dict]:
    """Entries of nested manifests (prefixed with their directory) for the files they list."""
    reused: dict[str, dict] = {}
    for rel in rels:
        if rel.endswith("/" + MANIFEST):
            sub = rel[: -len(MANIFEST) - 1]
            try:
                reused.update({f"{sub}/{k}": v for k, v in read_manifest(root / sub).items()})
            except CheckpointDamaged:
                continue  # hash those files ourselves
    present = set(rels)
    return {k: v for k, v in reused.items() if k in present}


def write_manifest(root: str | Path, *, entries: dict[str, dict] | None = None) -> dict[str, dict]:
    """Write `root/MANIFEST.json` for every file under `root` (hashed unless given in `entries`
    or listed by a nested manifest); written to a temporary name, synced, then renamed."""
    root = Path(root)
    rels = list_files(root)
    known = {**_entries_reusing_nested(root, rels), **(entries or {})}
    files = {**hash_files(root, [r for r in rels if r not in known]), **{r: known[r] for r in rels if r in known}}
    files = dict(sorted(files.items()))
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
    return files


def check_files(root: str | Path, entries: dict[str, dict]) -> list[str]:
    """Problems of the files `entries` lists: missing, wrong size, then (only for the files whose
    size is right) wrong sha256. Empty when all match."""
    root = Path(root)
    problems, to_hash = [], []
    for rel, want in entries.items():
        p = root / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
        elif (size := p.stat().st_size) != want["size"]:
            problems.append(f"{rel} has {size} bytes where the manifest says {want['size']} (truncated or overwritten)")
        else:
            to_hash.append(rel)
    for rel, got in hash_files(root, to_hash).items():
        if got["sha256"] != entries[rel]["sha256"]:
            problems.append(f"{rel} has changed since it was written (its sha256 differs from the manifest)")
    return problems


def unlisted_files(root: str | Path, entries: dict[str, dict]) -> list[str]:
    return [f"{rel} is not in the manifest" for rel in list_files(root) if rel not in entries]


def verify(root: str | Path) -> None:
    """Raise CheckpointDamaged naming every file of `root` that differs from its manifest."""
    entries = read_manifest(root)
    problems = unlisted_files(root, entries) + check_files(root, entries)
    if problems:
        raise CheckpointDamaged(root, problems)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("verify", "write"):
        print("usage: python -m rlframe.utils.manifest verify|write DIR", file=sys.stderr)
        return 2
    cmd, root = argv
    if cmd == "write":
        print(f"{root}: {len(write_manifest(root))} files listed in {MANIFEST}")
        return 0
    try:
        verify(root)
    except CheckpointDamaged as err:
        print(err, file=sys.stderr)
        return 1
    print(f"{root}: verified")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
