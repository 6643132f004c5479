"""`run_training(cfg)`: one run, from its locked directory to its summary.

It builds the trainer `algorithm.name` selects, runs it in its run directory
(`<trainer.output_dir>/<trainer.experiment>`) and prints the summary. Before Ray or any worker
starts it locks the directory (lifecycle/run_lock.py: one live run per directory) and claims it for
this run (lifecycle/run_identity.py: a directory holding another run's files is refused, exit code 2).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rlframe.config.build import to_dict
from rlframe.config.schema import RunConfig
from rlframe.controller import trainers


def _trainer_and_restarts(cfg: RunConfig):
    from rlframe.controller.lifecycle.restart import fit_with_restarts

    return trainers.trainer_class(cfg), fit_with_restarts


def run_dir_in_use(cfg: RunConfig):
    """RunLocked (a ConfigError) when a live run holds the run directory of the loaded `cfg`, else None:
    asked before the config is validated and planned, whose checks would otherwise answer for that run
    (its trainer.prometheus_port is taken, by it; the planner reads its checkpoints). A dry run (which
    uses no run directory) gets None."""
    from rlframe.controller.lifecycle.run_lock import live_holder

    if cfg.trainer.dry_run:
        return None
    return live_holder(Path(cfg.trainer.output_dir) / cfg.trainer.experiment)


def run_training(cfg: RunConfig, *, config_name: str = "") -> dict:
    import yaml

    from rlframe.controller.lifecycle.run_identity import claim_run
    from rlframe.controller.lifecycle.run_lock import RunLock

    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.experiment
    lock = RunLock(run_dir).acquire()  # RunLocked (exit code 2) while another live process runs here
    try:
        claim_run(run_dir, cfg)  # RunDirConflict (exit code 2): the directory holds another run's files
        (run_dir / "config.yaml").write_text(yaml.safe_dump({"config_name": config_name, **to_dict(cfg)},
                                                            sort_keys=False))
        return _run_locked(cfg, run_dir)
    finally:
        lock.release()


def _run_locked(cfg: RunConfig, run_dir: Path) -> dict:
    import os

    from rlframe.utils import startup
    from rlframe.single_controller.ray_utils import start_ray_for_run
    from rlframe.controller.lifecycle.observability import observed
    from rlframe.controller.lifecycle.prelaunch import discard_launched, import_in_background, launch_hosts

    startup.reset()
    startup.mark("python, imports, config")
    # the trace and the /metrics endpoint (trainer.trace, trainer.prometheus_port) from here to the end
    with observed(cfg, run_dir):
        importer = import_in_background(_trainer_and_restarts, cfg)  # while Ray starts (prelaunch.py)
        # Workers import user modules (custom workers, algorithms) from where the job was started.
        start_ray_for_run(cfg, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
            p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)}})
        startup.mark("ray")
        launch_hosts(cfg)  # the worker processes start while the trainer loads the tokenizer and data
        trainer_cls, fit_with_restarts = importer.result()
        startup.mark("trainer imports")
        t0 = time.perf_counter()
        try:
            # A worker process that dies is reported, its groups restarted and the run resumed (restart.py).
            summary = fit_with_restarts(cfg, trainer_cls=trainer_cls, run_dir=run_dir)
        finally:
            discard_launched()
    summary["wall_time_s"] = round(time.perf_counter() - t0, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("summary: " + json.dumps(summary), flush=True)
    return summary
