"""Run a config for `steps` steps with the preflight observer attached, and report its checks.

    report = run_preflight(cfg, steps=2)      # real Ray, real worker groups, the config's own layout
    print(report.text()); exit(report.exit_code)

The run is the user's config with only what a check run must not do changed: no validation, no
checkpoints, no export, a throwaway run directory, `steps` steps.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rlframe.controller.preflight.checks import Check
from rlframe.controller.preflight.observer import PreflightObserver, actor_precision

EXIT_OK, EXIT_FAILED = 0, 1


@dataclass
class PreflightReport:
    config: str
    results: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.results if not c.ok]

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.failed else EXIT_OK

    def worst(self, prefix: str) -> float:
        """The largest value of the checks whose name starts with `prefix` (0 when none ran)."""
        return max((c.value for c in self.results if c.name.startswith(prefix)), default=0.0)

    def text(self) -> str:
        lines = [f"preflight {self.config}: {len(self.results)} checks, {len(self.failed)} failed"]
        lines += ["  " + c.line() for c in self.results]
        if not self.results:
            lines.append("  no check applied (nothing was generated?)")
        return "\n".join(lines)


def preflight_config(cfg, *, steps: int, output_dir: str):
    """The user's config as a check run: `steps` steps, nothing kept."""
    t = dataclasses.replace(cfg.trainer, total_steps=steps, val_every=0, save_every=0, resume="off", export_hf=False,
                            output_dir=output_dir, experiment="preflight", loggers=["jsonl"], plot=False,
                            progress_bar=False, max_restarts=0, check_weight_sync_every=0)
    return dataclasses.replace(cfg, trainer=t)


def run_preflight(cfg, *, steps: int = 2, config_name: str = "", output_dir: str | None = None) -> PreflightReport:
    """Run `cfg` for `steps` steps on real worker groups and check the invariants (checks.py)."""
    observer = PreflightObserver(cfg, precision=actor_precision(cfg))
    run_observed(cfg, observer, steps=steps, output_dir=output_dir)
    return PreflightReport(config=config_name, results=observer.results)


def run_observed(cfg, observer, *, steps: int, output_dir: str | None = None) -> None:
    """Run `cfg` as a check run (`preflight_config`) with `observer` attached to its trainer: its
    `before_update(trainer, batch)`, `after_step(trainer, metrics)` and `finish(steps)` are called."""
    from rlframe.single_controller.ray_utils import start_ray_for_run
    from rlframe.controller.trainers import trainer_class

    with tempfile.TemporaryDirectory(prefix="rlframe-preflight-") as tmp:
        cfg = preflight_config(cfg, steps=steps, output_dir=output_dir or tmp)
        run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.experiment
        run_dir.mkdir(parents=True, exist_ok=True)
        start_ray_for_run(cfg, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
            p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)}})
        trainer = trainer_class(cfg)(cfg, run_dir=run_dir)
        try:
            trainer.observer = observer
            if trainer.agent is not None:
                trainer.agent.turn_checks = []
            trainer.fit()
            observer.finish(trainer.step)
        finally:
            trainer.close()
