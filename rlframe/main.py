"""The main job: `python -m rlframe.main [--config-name NAME] [key=value ...]`.

With no arguments it runs configs/ppo_tiny.yaml: PPO with a critic on the tiny model, on CPU,
with the hybrid engine. `trainer.dry_run=true` validates a config and prints its placement,
layouts, resharding plan and memory estimate without starting anything.
"""

from __future__ import annotations

import argparse
import sys


def _configs_epilog() -> str:
    """--help's list of the built-in configs and config groups (a directory listing)."""
    from rlframe.config.load import CONFIGS_DIR
    from rlframe.config.show import config_choices

    return "\n".join(config_choices([CONFIGS_DIR]) + ["Options may come anywhere among the overrides."])


def _at_least_1(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of steps, at least 1")
    return int(text)


def parser(*, prog: str = "python -m rlframe.main", description: str | None = None,
           steps: bool = False) -> argparse.ArgumentParser:
    """The main job's arguments (and Hydra's own flags); `steps=True`: preflight's, with --steps."""
    from rlframe.config.show import INFO_KINDS

    p = argparse.ArgumentParser(prog=prog, description=description or __doc__, epilog=_configs_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if steps:
        p.add_argument("--steps", type=_at_least_1, default=2, help="how many steps to run and check (default 2)")
    p.add_argument("--config-name", "-cn", default="ppo_tiny", help="a file of configs/ without .yaml")
    p.add_argument("--config-path", "-cp", default=None,
                   help="a directory of your own YAML configs (they may extend the built-in ones by name)")
    p.add_argument("--cfg", "-c", choices=("job", "hydra", "all"),
                   help="print the composed config as YAML and exit 0, starting nothing: job (the run's keys; "
                   "trainer.dry_run=true type-checks and validates them), hydra (Hydra's own section), all")
    p.add_argument("--resolve", action="store_true", help="with --cfg or --info: resolve ${...} interpolations")
    p.add_argument("--info", "-i", nargs="?", const="all", metavar="{" + ",".join(INFO_KINDS) + "}",
                   help="print the config search path, the defaults list and the composed config (all), or one "
                   "of them, and exit 0")
    p.add_argument("overrides", nargs="*", help="Hydra overrides such as actor.lr=1e-4 or algorithm=dapo")
    return p


def parse(argv: list[str], **kw) -> argparse.Namespace:
    """The arguments, options anywhere among the overrides (as a Hydra application takes them)."""
    from rlframe.config.show import INFO_KINDS

    p = parser(**kw)
    args = p.parse_intermixed_args(argv)
    if args.info is not None and args.info not in INFO_KINDS:
        if "=" not in args.info and not args.info.startswith(("+", "~")):
            p.error(f"argument --info/-i: invalid choice: {args.info!r} (choose from {', '.join(INFO_KINDS)})")
        args.overrides.insert(0, args.info)  # an override after a bare --info
        args.info = "all"
    if args.resolve and not (args.cfg or args.info):
        p.error("--resolve applies to what --cfg or --info prints: add --cfg job")
    return args


def parse_args(argv: list[str]) -> tuple[str, list[str], str | None]:
    args = parse(argv)
    return args.config_name, args.overrides, args.config_path


def show_config(args) -> int:
    """--cfg / --info: print Hydra's composition of the config; nothing starts. Exit 0, 2 for a config error."""
    from rlframe.config.show import config_text, info_text

    try:
        if args.info:
            text = info_text(args.config_name, args.overrides, args.config_path, kind=args.info, resolve=args.resolve)
        else:
            text = config_text(args.config_name, args.overrides, args.config_path, cfg=args.cfg, resolve=args.resolve)
    except ValueError as err:
        print(f"rlframe: {err}", file=sys.stderr)
        return 2
    print(text.rstrip("\n"), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from rlframe.config import ConfigError

    args = parse(sys.argv[1:] if argv is None else argv)
    if args.cfg or args.info:
        return show_config(args)
    name, overrides, config_path = args.config_name, args.overrides, args.config_path
    from rlframe.config import load_config
    from rlframe.controller.run import run_dir_in_use
    from rlframe.plan.command import planned

    try:
        cfg = load_config(name, overrides, extra_dir=config_path)
        in_use = run_dir_in_use(cfg)  # first: the port a live run holds is its own
        if in_use is not None:
            raise in_use
        cfg = planned(cfg)
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
    from rlframe.controller.trainers.dynamic_sampling import DynamicSamplingExhausted

    check_cpu_precision(cfg)  # bf16 on a CPU whose bf16 matmuls are slower than fp32: say so
    try:
        run_training(cfg, config_name=name)
    except ConfigError as err:  # what a joined Ray cluster cannot provide, found once joined
        print(f"rlframe: {err}", file=sys.stderr)
        return 2
    except (NonFiniteTrainingError, WorkerRestartsExhausted, NodeLost, InvariantViolation,
            RewardErrorsExceeded, CheckpointWriteFailed, RunFilesWriteFailed, DynamicSamplingExhausted) as err:  # metrics so far are in the run directory
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

    args = parse(argv, prog="rlframe preflight", description=preflight_main.__doc__, steps=True)
    if args.cfg or args.info:
        return show_config(args)
    steps, name, overrides, config_path = args.steps, args.config_name, args.overrides, args.config_path
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
