"""The run's jsonl files keyed by training step (metrics.jsonl, generations/*.jsonl): reading them,
trimming them to a resumed step, and appending with rotation by size.

A resumed run continues from the checkpoint of step s; rows of steps > s that the earlier attempt
wrote after that checkpoint (before a crash or a signal) are dropped first, so each step's rows are
in a file once. A line a kill cut off mid-write does not parse and is dropped with them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a jsonl file ([] when it does not exist); lines that do not parse are skipped."""
    if not path.exists():
        return []
    with path.open() as f:
        return [row for line in f if (row := _parse(line)) is not None]


def trim_jsonl(path: Path, upto_step: int) -> int:
    """Keep the rows of steps <= upto_step (-1: none): the file is rewritten (atomically: a new file
    renamed over it) only when it held other rows or a line that does not parse. Returns the number of
    lines dropped. Streams: a file of hundreds of MB is never held in memory."""
    if not path.exists():
        return 0
    with path.open() as src:  # read-only first: most files (rotated ones, older steps) keep every line
        if not any(_dropped(line, upto_step) for line in src):
            return 0
    tmp = path.with_name(f".{path.name}.trim")
    dropped = 0
    try:
        with path.open() as src, tmp.open("w") as dst:
            for line in src:
                if not line.strip():
                    continue
                if _dropped(line, upto_step):
                    dropped += 1
                    continue
                dst.write(line if line.endswith("\n") else line + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a full disk mid-copy leaves no half file behind
    return dropped


def _dropped(line: str, upto_step: int) -> bool:
    """A non-empty line that does not parse (cut by a kill) or holds a row of a step > upto_step."""
    if not line.strip():
        return False
    row = _parse(line)
    return row is None or row.get("step", 0) > upto_step


def _parse(line: str) -> dict | None:
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


class RotatingJsonl:
    """`<dir>/<name>.jsonl`, rotated when it reaches `max_bytes`: the full file becomes `.jsonl.1`
    (the previous `.1` becomes `.2`, ...) and the oldest beyond `keep` rotated files is deleted, so a
    name never takes more than about (keep + 1) x max_bytes. Rows are appended whole (one write per
    batch of rows), so a file only ever ends in a cut line when the process was killed mid-write."""

    def __init__(self, directory: Path, name: str, *, max_bytes: int, keep: int = 2):
        self.path = Path(directory) / f"{name}.jsonl"
        self.max_bytes, self.keep = max_bytes, keep

    def parts(self) -> list[Path]:
        """Its files that exist, newest first (name.jsonl, name.jsonl.1, ...)."""
        names = [self.path] + [self.path.with_name(f"{self.path.name}.{i}") for i in range(1, self.keep + 1)]
        return [p for p in names if p.exists()]

    def append(self, rows: list[dict]) -> None:
        if not rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size >= self.max_bytes:
            self._rotate()
        with self.path.open("a") as f:
            f.write("".join(json.dumps(r, default=str) + "\n" for r in rows))  # str: a field JSON has no form for

    def _rotate(self) -> None:
        part = lambda i: self.path.with_name(f"{self.path.name}.{i}") if i else self.path  # noqa: E731
        part(self.keep).unlink(missing_ok=True)
        for i in range(self.keep - 1, -1, -1):
            if part(i).exists():
                os.replace(part(i), part(i + 1))

    def trim(self, upto_step: int) -> int:
        """trim_jsonl on each of its files; returns the lines dropped."""
        return sum(trim_jsonl(p, upto_step) for p in self.parts())
