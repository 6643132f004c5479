"""Run checkpoints: written atomically, found again by `trainer.resume`, pruned only when complete.

Layout: `<run_dir>/checkpoints/step_000010/` holds one directory per trained role (the engines'
sharded model/optimizer/scheduler/RNG state) and `trainer_state.json` (step, dataloader position,
KL controller, the driver's RNG states). Everything is first written to `.tmp-step_000010/` and
renamed into place, so a crash mid-write never leaves a directory that resume would pick: a
checkpoint exists iff its final name exists.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

_STEP_RE = re.compile(r"^step_(\d{6,})$")
STATE_FILE = "trainer_state.json"


def driver_rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state().tolist()}


def restore_driver_rng(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


class CheckpointManager:
    def __init__(self, run_dir: Path, *, keep: int):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = max(1, keep)

    def complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / STATE_FILE).is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint `trainer.resume` asks for: auto (latest here, if any), off, or a path."""
        if resume == "off":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume).expanduser()
        if not (path / STATE_FILE).is_file():
            raise ValueError(f"trainer.resume={resume!r} is not a complete checkpoint (no {STATE_FILE}); "
                             f"pick one of {[str(p) for _, p in self.complete()]} or use resume=auto")
        return path

    def save(self, step: int, *, save_roles, state: dict) -> Path:
        """`save_roles(tmp_dir)` makes the workers write their shards under tmp_dir; then the
        driver's state goes in last and the directory is renamed into place."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_roles(tmp)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}))
        if final.exists():  # the same step saved before (e.g. a resumed run): replace it whole
            shutil.rmtree(final)
        tmp.rename(final)
        self._prune()
        return final

    def load_state(self, path: Path) -> dict:
        return json.loads((Path(path) / STATE_FILE).read_text())

    def _prune(self) -> None:
        done = self.complete()
        for _, p in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(p, ignore_errors=True)
