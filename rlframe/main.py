"""The main job: `python -m rlframe.main [--config-name NAME] [key=value ...]`.

With no arguments it runs configs/ppo_tiny.yaml: PPO with a critic on the tiny model, on CPU,
with the hybrid engine. `trainer.dry_run=true` validates a config and prints its placement,
layouts, resharding plan and memory estimate without starting anything.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str]) -> tuple[str, list[str], str | None]:
    p = argparse.ArgumentParser(prog="python -m rlframe.main", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-name", "-cn", default="ppo_tiny", help="a file of configs/ without .yaml")
    p.add_argument("--config-path", "-cp", default=None,
                   help="a directory of your own YAML configs (they may extend the built-in ones by name)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides such as actor.lr=1e-4")
    args = p.parse_args(argv)
    return args.config_name, args.overrides, args.config_path


def main(argv: list[str] | None = None) -> int:
    from rlframe.config import ConfigError

    name, overrides, config_path = parse_args(sys.argv[1:] if argv is None else argv)
    from rlframe.plan.command import planned_config

    try:
        cfg = planned_config(name, overrides, config_path)
    except (ConfigError, ValueError) as err:
        print(f"rlframe: {err}", file=sys.stderr)
        return 2
    if cfg.trainer.dry_run:
        from rlframe.plan.dry_run import describe_run

        print(f"config {name}: valid (dry run: model/data paths are not checked)\n{describe_run(cfg)}")
        return 0
    from rlframe.controller.cpu_precision import check_cpu_precision
    from rlframe.controller.preflight.checks import InvariantViolation
    from rlframe.controller.run import run_training
    from rlframe.controller.lifecycle.checkpoint import CheckpointWriteFailed
    from rlframe.controller.lifecycle.node_loss import NodeLost
    from rlframe.controller.lifecycle.nonfinite import NonFiniteTrainingError
    from rlframe.controller.lifecycle.preemption import Preempted
    from rlframe.controller.lifecycle.restart import WorkerRestartsExhausted
    from rlframe.controller.lifecycle.tracking import RunFilesWriteFailed
    from rlframe.rewards.manager import RewardErrorsExceeded

    check_cpu_precision(cfg)  # bf16 on a CPU whose bf16 matmuls are slower than fp32: say so
    try:
        run_training(cfg, config_name=name)
    except ConfigError as err:  # what a joined Ray cluster cannot provide, found once joined
        print(f"rlframe: {err}", file=sys.stderr)
        return 2
    except (NonFiniteTrainingError, WorkerRestartsExhausted, NodeLost, InvariantViolation,
            RewardErrorsExceeded, CheckpointWriteFailed, RunFilesWriteFailed) as err:  # metrics so far are in the run directory
        print(f"rlframe: {err}", file=sys.stderr)
        return 1
    except Preempted as stop:  # SIGTERM / SIGINT: checkpointed at a step boundary (preemption.py)
        print(f"rlframe: {stop.line}", file=sys.stderr, flush=True)
        return stop.code
    return 0


def preflight_main(argv: list[str]) -> int:
    """`rlframe preflight [--steps N] [--config-name NAME] [key=value ...]`: run the config for N steps
    (default 2) at its real layout and check the invariants of any correct RL run
    (controller/preflight). Exit 0 when all hold, 1 when one fails (each failure names its likely
    cause and settings), 2 for a config error."""
    from rlframe.config import ConfigError

    steps = 2
    if argv[:1] == ["--steps"] and len(argv) > 1:
        steps, argv = int(argv[1]), argv[2:]
    name, overrides, config_path = parse_args(argv)
    from rlframe.plan.command import planned_config

    try:
        cfg = planned_config(name, overrides, config_path)
    except (ConfigError, ValueError) as err:
        print(f"rlframe: {err}", file=sys.stderr)
        return 2
    from rlframe.config.algorithms import algorithm_spec

    if not algorithm_spec(cfg.algorithm).generates:
        print(f"rlframe: preflight checks RL runs; {cfg.algorithm.name} has no rollout to check", file=sys.stderr)
        return 2
    from rlframe.controller.preflight.run import run_preflight

    report = run_preflight(cfg, steps=steps, config_name=name)
    print(report.text(), flush=True)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
