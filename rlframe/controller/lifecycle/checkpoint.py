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

Bound to a run (`bind`, run_identity.RunRecord), the manager writes the run's record and the resolved
config into every checkpoint (`run.json`), and sees only that run's checkpoints: resume=auto continues
from, and retention deletes, this run's checkpoints only; another run's are never touched.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from rlframe.controller.lifecycle import run_identity
from rlframe.utils import manifest

STATE_FILE = "trainer_state.json"
PARTIAL_PREFIX = ".tmp-"


class CheckpointWriteFailed(RuntimeError):
    """A checkpoint could not be written (a full disk, most often): its partial directory is removed,
    the earlier checkpoints are intact; the message is one line naming the directory, the bytes needed
    and free, and the newest intact checkpoint."""


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
    def __init__(self, run_dir: Path, *, keep: int, run: run_identity.RunRecord | None = None,
                 config: dict | None = None, estimate_bytes: int = 0):
        """`estimate_bytes`: about the size of a checkpoint before one was written (the trainer's estimate
        from the model and optimizer state, plan.memory_estimate.checkpoint_bytes); the free-space check
        of the first checkpoint uses it, later ones the size of the newest."""
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.keep = max(1, keep)
        self.run, self.config = run, config
        self.estimate_bytes = max(0, int(estimate_bytes))

    def bind(self, run: run_identity.RunRecord, *, config: dict | None = None) -> None:
        """From now on: checkpoints record `run` and `config`; only `run`'s are listed, resumed, pruned.
        Partial directories an earlier attempt left (it died writing) are removed: the run directory's
        lock means no other live process is writing them, and nothing ever reads them."""
        self.run, self.config = run, config
        self.remove_partial()

    def remove_partial(self) -> list[Path]:
        from rlframe.utils.console import say

        partial = sorted(self.root.glob(PARTIAL_PREFIX + "*")) if self.root.is_dir() else []
        for p in partial:
            shutil.rmtree(p, ignore_errors=True)
            say(f"removed {p}: a checkpoint an earlier attempt did not finish writing")
        return partial

    def all_complete(self) -> list[tuple[int, Path]]:
        """Every complete checkpoint in the directory, whichever run wrote it."""
        return run_identity.complete_checkpoints(self.run_dir)

    def _attempt(self, path: Path) -> int | None:
        return run_identity.checkpoint_attempt(self.run, Path(path), run_identity.checkpoint_run_info(path))

    def is_own(self, path: Path) -> bool:
        """Written by the bound run, this start or an earlier one (every checkpoint is, while no run is bound)."""
        return self.run is None or self._attempt(path) is not None

    def complete(self) -> list[tuple[int, Path]]:
        """This run's complete checkpoints of its current start (trainer.resume=off starts over), oldest first."""
        if self.run is None:
            return self.all_complete()
        return [(step, p) for step, p in self.all_complete() if self._attempt(p) == self.run.attempt]

    def superseded(self) -> list[Path]:
        """This run's checkpoints of a start before trainer.resume=off started it over."""
        if self.run is None:
            return []
        return [p for _, p in self.all_complete() if self._attempt(p) not in (None, self.run.attempt)]

    def others(self) -> list[Path]:
        """Complete checkpoints of other runs in the directory (never resumed from, never deleted)."""
        return [p for _, p in self.all_complete() if not self.is_own(p)]

    def run_info(self, path: Path) -> dict | None:
        """The run record and config a checkpoint was written with (None: written before they were)."""
        return run_identity.checkpoint_run_info(path)

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

    def latest(self, *, warn: bool = True) -> Path | None:
        """The checkpoint `trainer.resume=auto` continues from: the newest that verifies."""
        done = self.complete()
        found = self.newest_verified(warn=warn)
        if done and found is None:
            raise ValueError(
                f"trainer.resume=auto: none of the {len(done)} checkpoints in {self.root} verifies against its "
                f"manifest (warnings above name the damaged files); restore one, or start over with "
                "trainer.resume=off (retention then deletes these as new checkpoints are saved)")
        return found

    def resolve(self, resume: str, *, announce: bool = True) -> Path | None:
        """The checkpoint `trainer.resume` asks for: auto (newest verified here, if any), off, or a path
        (which must verify). The one decision of what a launch resumes: the planner asks it
        (`resume_checkpoint`), the trainer loads it, a restart continues from it."""
        if resume == "off":
            return None
        if resume == "auto":
            from rlframe.utils.console import say

            others, superseded = self.others(), self.superseded()
            if not announce:
                return self.latest(warn=False)
            if others:
                say(f"ignoring {len(others)} checkpoint(s) of other runs in {self.root} (kept, never resumed "
                    f"from): {', '.join(p.name for p in others)}; trainer.resume=PATH continues from one explicitly")
            if superseded:
                say(f"ignoring {len(superseded)} checkpoint(s) of this run from before trainer.resume=off started it "
                    f"over: {', '.join(p.name for p in superseded)}")
            return self.latest()
        return check_resume_path(resume, self.complete())

    def save(self, step: int, *, save_roles, state: dict) -> Path:
        """`save_roles(tmp_dir)` makes the workers write their shards under tmp_dir; then the
        driver's state and the manifest go in last and the directory is renamed into place."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"{PARTIAL_PREFIX}{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        need = self._check_space(step)
        try:
            tmp.mkdir(parents=True)
            save_roles(tmp)
            if self.run is not None:  # who wrote it, with which settings (run_identity.py)
                (tmp / run_identity.RUN_FILE).write_text(json.dumps(
                    {"run_id": self.run.run_id, "attempt": self.run.attempt, "identity": self.run.identity,
                     "config": self.config}))
            (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}))
            manifest.write_manifest(tmp)
        except Exception as err:
            full = _out_of_space(err, self.root)  # asked before the partial directory frees its space
            shutil.rmtree(tmp, ignore_errors=True)  # never left behind to fill the disk or be tripped over
            if not full:
                raise  # e.g. a worker died: the restart logic handles it
            raise CheckpointWriteFailed(self._failure_line(step, need, f"the disk filled up ({_first_line(err)})")) from None
        from rlframe.controller.lifecycle import run_lock

        run_lock.check_held(self.run_dir)  # a run that lost its directory's lock writes nothing more there
        if final.exists():  # the same step saved before (e.g. a resumed run): replace it whole
            if not self.is_own(final):
                shutil.rmtree(tmp, ignore_errors=True)
                raise run_identity.RunDirConflict(
                    f"{final} was written by another run ({(self.run_info(final) or {}).get('run_id', 'unknown')}); "
                    "this run does not overwrite it. Move it out of the run directory, or give this run its own "
                    "trainer.experiment")
            shutil.rmtree(final)
        tmp.rename(final)
        self._prune(just_saved=final)
        return final

    def _check_space(self, step: int) -> int:
        """Bytes the checkpoint will take (the size of this run's newest one; before the first, the
        estimate from the model and optimizer state); CheckpointWriteFailed before anything is written
        when the disk has less free."""
        done = self.complete()
        need = _tree_bytes(done[-1][1]) if done else self.estimate_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        if need > _free_bytes(self.root):
            why = "not enough free space" + ("" if done else " (the size estimated from the model and optimizer state)")
            raise CheckpointWriteFailed(self._failure_line(step, need, why))
        return need

    def _failure_line(self, step: int, need: int, why: str) -> str:
        newest = self.newest_verified(warn=False)
        free = _free_bytes(self.root) if self.root.exists() else 0
        return (f"checkpoint of step {step} not written in {self.root}: {why}; it needs about {need / 2**20:.1f} MiB, "
                f"{free / 2**20:.1f} MiB are free; newest intact checkpoint: {newest or 'none'} (free space and run "
                "the same command again to resume from it)")

    def load_state(self, path: Path) -> dict:
        return json.loads((Path(path) / STATE_FILE).read_text())

    def _prune(self, just_saved: Path | None = None) -> None:
        """Keep this run's `keep` newest checkpoints, the one just saved (after a resume from an explicit
        older checkpoint it numbers below the branch left behind, and is the one a resume continues),
        and, if it is not among them, its newest one that verifies (read back from disk now); delete
        this run's others, and once one of this start verifies, the checkpoints of the run's earlier
        starts (trainer.resume=off). Other runs' are never deleted."""
        done = self.complete()
        keep = {p for _, p in done[-self.keep:]} | ({just_saved} if just_saved is not None else set())
        verified = self.newest_verified()
        if verified is not None:
            keep.add(verified)
        doomed = [p for _, p in done if p not in keep] + (self.superseded() if verified is not None else [])
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# torch.save's zip writer reports a short write (a full disk) without errno: "basic_ios::clear: iostream
# error" for the record, then "[enforce fail at inline_container.cc:NNN] . unexpected pos 704 vs 598" for the
# end of the file (the error raised): a full disk only when the disk is (nearly) full then.
ZIP_WRITER_SHORT_WRITE = ("unexpected pos", "enforce fail at inline_container", "basic_ios::clear: iostream error")
NEARLY_FULL_BYTES = 64 * 2**20  # free space below which a short write is taken for a full disk


def _out_of_space(err: BaseException, root: Path | None = None) -> bool:
    """A write failed for a full disk (or quota), raised here or inside a worker (its text travels).
    torch's zip writer says only "unexpected pos": that counts when the filesystem of `root` has less
    than NEARLY_FULL_BYTES free (os.statvfs), asked before the partial directory is removed."""
    import errno

    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    if "No space left on device" in text or "Disk quota exceeded" in text:
        return True
    if root is not None and any(s in text for s in ZIP_WRITER_SHORT_WRITE):
        return _free_bytes(root) < NEARLY_FULL_BYTES
    return False


def _free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `path` (its nearest existing parent)."""
    import os

    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _first_line(err: BaseException) -> str:
    lines = [ln for ln in str(err).splitlines()
             if "No space left" in ln or "quota" in ln.lower() or ZIP_WRITER_SHORT_WRITE[0] in ln]
    return (lines[0] if lines else str(err).splitlines()[0] if str(err) else type(err).__name__).strip()[:200]


def check_resume_path(resume: str, known: list[tuple[int, Path]] = ()) -> Path:
    """An explicit `trainer.resume` path, checked to be a complete checkpoint that verifies."""
    path = Path(resume).expanduser()
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"trainer.resume={resume!r} is not a complete checkpoint (no {STATE_FILE}); "
                         f"pick one of {[str(p) for _, p in known]} or use resume=auto")
    manifest.verify(path)
    return path


def resume_checkpoint(run_dir: str | Path, resume: str) -> Path | None:
    """What `trainer.resume` resolves to in `run_dir` as the directory stands, decided by the checkpoint
    manager's rule (`CheckpointManager.resolve`) for the run the directory holds, without claiming it:
    for the planner, which keeps the layout of the checkpoint the trainer will then load. Raises
    ValueError where the trainer would (a path that does not verify; auto with none that does)."""
    run = run_identity.current_record(run_dir)
    return CheckpointManager(Path(run_dir), keep=1, run=run).resolve(resume, announce=False)
