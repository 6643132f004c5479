"""Trainers: the algorithms as dataflows over worker groups (driver side).

`run_training(cfg)` builds the trainer `algorithm.name` selects, runs it in a fresh run directory
(`<trainer.output_dir>/<trainer.experiment>`) and prints the summary.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rlframe.config.build import to_dict
from rlframe.config.schema import RunConfig


def trainer_class(cfg: RunConfig):
    if cfg.algorithm.trainer is not None:
        from rlframe.config.validate import load_class

        return load_class(cfg.algorithm.trainer)
    if cfg.algorithm.name == "sft":
        from rlframe.controller.trainers.sft import SFTTrainer

        return SFTTrainer
    if cfg.algorithm.name == "online_dpo":
        from rlframe.controller.trainers.dpo import OnlineDPOTrainer

        return OnlineDPOTrainer
    from rlframe.controller.trainers.ppo import PPOTrainer

    return PPOTrainer


def _trainer_and_restarts(cfg: RunConfig):
    from rlframe.controller.trainers.restart import fit_with_restarts

    return trainer_class(cfg), fit_with_restarts


def run_training(cfg: RunConfig, *, config_name: str = "") -> dict:
    import os

    import yaml

    from rlframe.controller import startup
    from rlframe.controller.ray_utils import start_ray_for_run
    from rlframe.controller.trainers.prelaunch import discard_launched, import_in_background, launch_hosts

    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.experiment
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"config_name": config_name, **to_dict(cfg)}, sort_keys=False))
    startup.reset()
    startup.mark("python, imports, config")
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
