"""A working directory as the README's first command leaves a clone: `make demo` runs ppo_tiny with
its default output directory and leaves `outputs/ppo_tiny/checkpoints/step_000060`, written by 2
processes (actor and critic dp2), which a later launch in the same directory resumes (and
`trainer.auto_plan` keeps its layout). Tests that run the main job must not see it: they run in
their own directories, whatever the clone's `outputs/` holds. `clone_after_demo` makes such a
directory (the repository's entries linked, its own `outputs/` holding that checkpoint, nothing
trained) for tests to run in and prove it."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_STEP = "step_000060"


def plant_demo_checkpoint(cwd: Path) -> Path:
    """`cwd`/outputs/ppo_tiny/checkpoints/step_000060 as the demo writes it (what resume reads of it:
    run.json with the demo's config, 2 processes and dp2, a verifying manifest; no weights)."""
    from rlframe.config import load_config
    from rlframe.config.build import to_dict
    from rlframe.utils import manifest

    cfg = load_config("ppo_tiny", [])
    assert (cfg.resources.procs_per_node, cfg.actor.dp) == (2, 2), "the demo's layout changed: update this"
    ckpt = cwd / "outputs" / cfg.trainer.experiment / "checkpoints" / DEMO_STEP
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 60}))
    from rlframe.controller.lifecycle.run_identity import config_dict, identity_of

    (ckpt / "run.json").write_text(json.dumps({"run_id": "demo", "identity": identity_of(config_dict(cfg)),
                                               "config": to_dict(cfg)}))
    manifest.write_manifest(ckpt)
    return ckpt


def clone_after_demo(dest: Path) -> Path:
    """`dest` as a copy of the repository root after `make demo`: its top-level entries linked (not
    copied), except outputs/, which holds the demo's checkpoint only."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name not in ("outputs", ".git", ".pytest_cache"):
            (dest / entry.name).symlink_to(entry)
    plant_demo_checkpoint(dest)
    return dest
