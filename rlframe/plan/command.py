"""`rlframe plan`: the plans a run could use on its cluster, ranked by their estimated step time.

    rlframe plan [-cn CONFIG] [key=value ...] [--top N] [--write FILE] [--max-staleness K] [--constants FILE]
    rlframe plan --calibrate [-cn CONFIG] [key=value ...] [--constants FILE]

Enumerates (plan/space.py) every placement and layout of CONFIG's roles on its cluster
(resources.nodes x procs_per_node processes) that the config rules accept and, on GPUs, whose
devices hold them (the dry run's memory estimate); estimates each one's step (plan/cost.py) with the
machine's constants (`--calibrate` measures them here and stores them, default
~/.cache/rlframe/plan_constants.json); prints the best N with their phases; `--write` stores the best
as a complete config that runs as is (`python -m rlframe.main --config-path DIR --config-name NAME`).
Exit 0, or 2 for a config error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_CONSTANTS = Path("~/.cache/rlframe/plan_constants.json").expanduser()
SHOWN_PHASES = ("gen", "ref", "old_log_prob", "values", "update_critic", "update_actor", "update_weights")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlframe plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-name", "-cn", default="ppo_tiny")
    p.add_argument("--config-path", "-cp", default=None)
    p.add_argument("--top", type=int, default=10, help="plans to print (default 10)")
    p.add_argument("--write", type=Path, default=None, help="store the best plan as this YAML config")
    p.add_argument("--constants", default=str(DEFAULT_CONSTANTS),
                   help="the machine's fitted constants (a file), or h100-assumed (datasheet figures: docs/plan.md)")
    p.add_argument("--max-staleness", type=int, default=None,
                   help="plans may generate up to K steps ahead of training (default: the config's trainer.max_staleness)")
    p.add_argument("--calibrate", action="store_true", help="measure the constants on this machine first")
    p.add_argument("overrides", nargs="*")
    return p.parse_intermixed_args(argv)


def ranked(base, dims, constants, **kw):
    """(estimate, plan, config) for every plan of `base`, fastest first; and the enumeration."""
    from rlframe.plan.cost import estimate
    from rlframe.plan.space import enumerate_plans

    space = enumerate_plans(base, dims, **kw)
    rows = sorted(((estimate(cfg, dims, constants), plan, cfg) for plan, cfg in space.plans),
                  key=lambda r: r[0].total)
    return rows, space


def load_constants(setting: str | Path = DEFAULT_CONSTANTS):
    """(constants, whether they are the defaults): a preset name, else a file, else the defaults."""
    from rlframe.plan.cost import PRESETS, Constants


    if str(setting) in PRESETS:
        return PRESETS[str(setting)], False
    if Path(setting).is_file():
        return Constants.load(Path(setting)), False
    return Constants(), True


def resumed_plan(cfg):
    """(the plan the checkpoint this launch resumes was written with, its path), or None: a resumed
    run keeps its layout (a checkpoint loads into the layout that wrote it). The checkpoint is the one
    the trainer will load (lifecycle/checkpoint.resume_checkpoint: this run's newest that verifies, for
    resume=auto); none, or one the trainer would refuse, leaves the plan to the search (the trainer
    then says why it refuses)."""
    from rlframe.controller.lifecycle.checkpoint import resume_checkpoint
    from rlframe.controller.lifecycle.run_identity import checkpoint_run_info, config_dict, identity_diff, identity_of
    from rlframe.plan.space import plan_of

    t = cfg.trainer
    try:
        found = resume_checkpoint(Path(t.output_dir).expanduser() / t.experiment, t.resume)
    except ValueError:
        return None
    info = checkpoint_run_info(found) if found else None
    if not info or "config" not in info:
        return None
    if identity_diff(info.get("identity", {}), identity_of(config_dict(cfg))):
        return None  # another run's checkpoint: the trainer refuses the directory (RunDirConflict), naming the keys
    try:
        return plan_of(cfg, info["config"]), found
    except (KeyError, TypeError):  # written by a version without some of the keys: plan afresh
        return None


def _dry_run_problems(cfg) -> list[str]:
    """What the validator says of `cfg` as a dry run (no files opened, nothing bound); [] when sound."""
    import dataclasses

    from rlframe.config import ConfigError, validate

    try:
        validate(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, dry_run=True)))
    except ConfigError as err:
        return list(err.problems)
    return []


def check_resumed_plan_fits(cfg, planned, plan, where) -> None:
    """ConfigError when the layout of the checkpoint this launch resumes (`plan`, kept by auto_plan)
    does not fit this launch's resources: it says that the checkpoint was written with another layout,
    and the three ways on (resources that fit it, start over, another run directory), rather than
    the bare layout error of a layout the user never chose. Only what the resources cause is blamed on
    the checkpoint (the problems that the resources it was written on do not have); the config's
    other problems are left to the validator."""
    import dataclasses

    from rlframe.config import ConfigError
    from rlframe.config.validate import _check_layouts
    from rlframe.controller.lifecycle.run_identity import checkpoint_run_info

    res = cfg.resources
    written = ((checkpoint_run_info(where) or {}).get("config") or {}).get("resources") or {}
    try:
        then = dataclasses.replace(planned, resources=dataclasses.replace(
            planned.resources, nodes=int(written["nodes"]), procs_per_node=int(written["procs_per_node"])))
    except (KeyError, TypeError, ValueError):  # written before checkpoints recorded their config's resources
        then = None
    if then is None:
        caused: list[str] = []
        _check_layouts(planned, caused)
    else:
        there = set(_dry_run_problems(then))
        caused = [p for p in _dry_run_problems(planned) if p not in there]
    if not caused:
        return  # the config's own problems, if any: validate() reports them as usual
    on = "" if then is None else f" on resources.nodes={then.resources.nodes} resources.procs_per_node={then.resources.procs_per_node}"
    fit = ("the resources it was written on" if then is None
           else f"resources.nodes={then.resources.nodes} resources.procs_per_node={then.resources.procs_per_node}")
    why = "; ".join(p.split("; set ")[0] for p in caused)  # their own advice (change the layout) does not apply
    raise ConfigError([
        f"trainer.auto_plan keeps the layout of the checkpoint this launch resumes ({where}), and that checkpoint "
        f"was written with another layout ({plan.label()}{on}) than this launch's resources (resources.nodes="
        f"{res.nodes} resources.procs_per_node={res.procs_per_node}) take ({why}); a checkpoint loads only into the "
        f"layout that wrote it. To continue that run, launch it with {fit}; to start it over here, set "
        "trainer.resume=off; to leave it and start a new run, set another trainer.experiment or trainer.output_dir"])


def _say(line: str) -> None:
    print(line, flush=True)


def auto_plan(cfg, constants_path: str | Path = DEFAULT_CONSTANTS, *, log=_say):
    """trainer.auto_plan: `cfg` with the fastest plan's placement and layouts (generation up to its
    own trainer.max_staleness ahead), or, when it resumes a checkpoint, that checkpoint's; says which,
    with what constants, and which of the config's settings the plan changed."""
    import dataclasses

    from rlframe.config import ConfigError
    from rlframe.plan.dry_run import model_dims

    kept = resumed_plan(cfg)
    if kept is not None:
        plan, where = kept
        log(f"rlframe: trainer.auto_plan keeps the plan of the checkpoint it resumes ({where}): {plan.label()}")
        planned = plan.apply(cfg)
        check_resumed_plan_fits(cfg, planned, plan, where)
        return planned
    constants, defaults = load_constants(constants_path)
    base = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, dry_run=True))
    try:
        dims = model_dims(base)
    except OSError as err:
        raise ConfigError([f"trainer.auto_plan needs the model's shapes, and model.path has no readable "
                           f"config.json ({err}); check model.path"]) from err
    rows, space = ranked(base, dims, constants)
    if not rows:
        if space.refused:  # the config's own problem (every plan has it): as the validator says it
            raise ConfigError(space.refused[0][1])
        raise ValueError("trainer.auto_plan: no plan fits these resources (rlframe plan lists why); add processes "
                         "or devices, or shrink the batch")
    est, plan, best = rows[0]
    from rlframe.plan.space import plan_of

    before = plan_of(cfg).values
    changed = [f"{k} {before[k]} -> {v}" for k, v in plan.settings if before.get(k) != v]
    log(f"rlframe: trainer.auto_plan chose {plan.label()}, estimated {est.total:.3f} s per step, fastest of "
        f"{len(rows)} plans ({constants.source}" + ("; run `rlframe plan --calibrate` for this machine's)" if defaults
                                                    else ")")
        + (f"; it set {', '.join(changed)}" if changed else ""))
    return dataclasses.replace(best, trainer=dataclasses.replace(best.trainer, dry_run=cfg.trainer.dry_run))


def planned_config(name: str, overrides: list[str], config_path: str | None = None, *, log=None):
    """The run's validated config; with trainer.auto_plan=true its placement and layouts are the
    planner's choice first (rlframe/plan), so the layout written in the config need not fit.
    `log` takes the planner's line (default: printed)."""
    from rlframe.config import load_config

    return planned(load_config(name, overrides, extra_dir=config_path), log=log)


def planned(cfg, *, log=None):
    """`planned_config` of a config already loaded."""
    from rlframe.config import validate
    from rlframe.config.algorithms import algorithm_spec, known

    plannable = known(cfg.algorithm) and not algorithm_spec(cfg.algorithm).dataflow  # else validate says why
    if cfg.trainer.auto_plan and plannable:
        cfg = auto_plan(cfg, log=log or _say)
    return validate(cfg)


def table(rows, top: int) -> str:
    lines = [f"{'#':>3} {'step s':>8}  " + " ".join(f"{p:>14}" for p in SHOWN_PHASES) + "  plan"]
    for i, (est, plan, _) in enumerate(rows[:top], 1):
        cells = " ".join(f"{est.phases[p]:14.3f}" if p in est.phases else f"{'-':>14}" for p in SHOWN_PHASES)
        lines.append(f"{i:>3} {est.total:8.3f}  {cells}  {plan.label()}")
    return "\n".join(lines)


def write_config(path: Path, cfg, *, header: str) -> None:
    """The whole config (no defaults list), so it runs as is wherever rlframe is installed."""
    import dataclasses

    import yaml

    raw = dataclasses.asdict(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, dry_run=False)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(raw, sort_keys=False))


def main(argv: list[str]) -> int:
    from rlframe.config import ConfigError, load_config
    from rlframe.plan.dry_run import model_dims

    args = parse(argv)
    try:  # not validated as it is: its layout may not fit the resources yet, which is what the plans choose
        base = load_config(args.config_name, [*args.overrides, "trainer.dry_run=true"], extra_dir=args.config_path)
    except (ConfigError, ValueError) as err:
        print(f"rlframe: {err}", file=sys.stderr)
        return 2
    if args.calibrate:
        from rlframe.plan.calibrate import calibrate

        try:
            constants = calibrate(args.config_name, args.overrides, config_path=args.config_path)
        except (ConfigError, ValueError) as err:
            print(f"rlframe: {err}", file=sys.stderr)
            return 2
        constants.save(Path(args.constants))
        print(f"constants ({constants.source}) written to {args.constants}")
    else:
        constants, defaults = load_constants(args.constants)
        if defaults:
            print(f"rlframe plan: no constants at {args.constants}: using defaults (run `rlframe plan --calibrate`)")
    dims = model_dims(base)
    try:
        rows, space = ranked(base, dims, constants, max_staleness=args.max_staleness)
    except ValueError as err:  # a trainer the cost model does not describe
        print(f"rlframe plan: {err}", file=sys.stderr)
        return 2
    res = base.resources
    print(f"{len(rows)} plans for {args.config_name} on {res.nodes} x {res.procs_per_node} "
          f"{'GPU' if res.use_gpu else 'CPU'} processes; constants: {constants.source}")
    if space.too_big:
        print(f"  {len(space.too_big)} more do not fit the devices (the dry run's memory estimate)")
    if space.refused:  # the enumeration's rules and the validator disagree: say so, it is a bug here
        print(f"  {len(space.refused)} plans the config rules refused, e.g. {space.refused[0][0].label()}: "
              f"{space.refused[0][1][0]}")
    if not rows:
        print("rlframe plan: no plan fits; add processes or devices, or shrink the batch", file=sys.stderr)
        return 2
    print(table(rows, args.top))
    if args.write:
        est, plan, cfg = rows[0]
        write_config(args.write, cfg, header=(
            f"rlframe plan --config-name {args.config_name} {' '.join(args.overrides)}\n"
            f"the fastest of {len(rows)} plans, estimated {est.total:.3f} s per step ({constants.source}):\n"
            f"{plan.label()}\nrun: python -m rlframe.main --config-path {args.write.parent} "
            f"--config-name {args.write.stem}"))
        print(f"best plan written to {args.write}")
    return 0
