"""Run checkpoints: written atomically, verified before use, pruned only behind a verified one.

Layout: `<run_dir>/checkpoints/step_000010/` holds one directory per trained role (the engines'
sharded model/optimizer/scheduler/RNG state, each with its own manifest), `trainer_state.json`
(step, dataloader position, KL controller, the driver's RNG states) and `MANIFEST.json` (size and
sha256 of every file, the roles' entries reused from their manifests), written last. Everything is
first written to `.tmp-step_000010/` and renamed into place, so a crash mid-write never leaves a
directory that resume would pick: a checkpoint exists iff its final name exists.

Damage after the rename (a truncated or changed file) is caught by the manifest:
- `trainer.resume=auto` skips a checkpoint that fails verification, with a warning naming each
  damaged file, and resumes from the newest one that verifies (an error if some exist but none does);
- an explicit `trainer.resume=PATH` that fails raises CheckpointDamaged (a ValueError) naming them;
- retention deletes old checkpoints only behind the newest verified one: a new checkpoint is verified
  after its rename, and the newest verified checkpoint is kept whatever `keep_checkpoints` says.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from rlframe.utils import manifest

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

    def newest_verified(self, *, warn: bool = True) -> Path | None:
        """The newest complete checkpoint whose files match its manifest (newer ones that do not are
        skipped, with a warning naming their damaged files); None when there is none."""
        for _, path in reversed(self.complete()):
            try:
                manifest.verify(path)
                return path
            except manifest.CheckpointDamaged as err:
                if warn:
                    warnings.warn(f"skipping {path}: {'; '.join(err.problems)}", stacklevel=2)
        return None

    def latest(self) -> Path | None:
        """The checkpoint `trainer.resume=auto` continues from: the newest that verifies."""
        done = self.complete()
        found = self.newest_verified()
        if done and found is None:
            raise ValueError(
                f"trainer.resume=auto: none of the {len(done)} checkpoints in {self.root} verifies against its "
                f"manifest (warnings above name the damaged files); restore one, or start over with "
                "trainer.resume=off (retention then deletes these as new checkpoints are saved)")
        return found

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint `trainer.resume` asks for: auto (newest verified here, if any), off, or a path
        (which must verify)."""
        if resume == "off":
            return None
        if resume == "auto":
            return self.latest()
        return check_resume_path(resume, self.complete())

    def save(self, step: int, *, save_roles, state: dict) -> Path:
        """`save_roles(tmp_dir)` makes the workers write their shards under tmp_dir; then the
        driver's state and the manifest go in last and the directory is renamed into place."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_roles(tmp)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}))
        manifest.write_manifest(tmp)
        if final.exists():  # the same step saved before (e.g. a resumed run): replace it whole
            shutil.rmtree(final)
        tmp.rename(final)
        self._prune()
        return final

    def load_state(self, path: Path) -> dict:
        return json.loads((Path(path) / STATE_FILE).read_text())

    def _prune(self) -> None:
        """Keep the `keep` newest checkpoints and, if it is not among them, the newest one that
        verifies (read back from disk now); delete the rest."""
        done = self.complete()
        keep = {p for _, p in done[-self.keep:]}
        verified = self.newest_verified()
        if verified is not None:
            keep.add(verified)
        for _, p in done:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)


def check_resume_path(resume: str, known: list[tuple[int, Path]] = ()) -> Path:
    """An explicit `trainer.resume` path, checked to be a complete checkpoint that verifies."""
    path = Path(resume).expanduser()
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"trainer.resume={resume!r} is not a complete checkpoint (no {STATE_FILE}); "
                         f"pick one of {[str(p) for _, p in known]} or use resume=auto")
    manifest.verify(path)
    return path
