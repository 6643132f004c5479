"""Compose a run's YAML with Hydra (configs/NAME.yaml + key=value overrides) into a RunConfig."""

from __future__ import annotations

from pathlib import Path

from rlframe.config.build import build_config
from rlframe.config.schema import RunConfig

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def available_configs(configs_dir: Path = CONFIGS_DIR) -> list[str]:
    return sorted(p.stem for p in configs_dir.glob("*.yaml"))


def config_groups(dirs: list[Path]) -> set[str]:
    """Config groups (sub-directories of yaml files, e.g. `algorithm`): `algorithm=dapo` selects one."""
    return {p.name for d in dirs if d.is_dir() for p in d.iterdir() if p.is_dir() and any(p.glob("*.yaml"))}


def _upsert(override: str, groups: set[str] = frozenset()) -> str:
    """`key=value` -> `++key=value`: a key the YAML leaves at its schema default can still be set
    (typos are caught by the schema, with suggestions, in build_config). A config group's selection
    (`algorithm=dapo`, no dot) stays as it is: Hydra picks that group's file."""
    if override.startswith(("+", "~")) or override.partition("=")[0] in groups:
        return override
    return "++" + override


def load_config(name: str = "ppo_tiny", overrides: list[str] | None = None, *,
                configs_dir: Path = CONFIGS_DIR, extra_dir: str | Path | None = None) -> RunConfig:
    """Compose `<name>.yaml` with Hydra overrides (`actor.lr=1e-4`) and type-check it.

    `extra_dir` (e.g. a user's own config directory) is searched first; its files may list the
    built-in configs in their `defaults:` (e.g. `- grpo_tiny`).
    """
    from omegaconf import OmegaConf

    composed = compose_config(name, overrides, configs_dir=configs_dir, extra_dir=extra_dir)
    return build_config(OmegaConf.to_container(composed, resolve=True))


def compose_config(name: str = "ppo_tiny", overrides: list[str] | None = None, *, configs_dir: Path = CONFIGS_DIR,
                   extra_dir: str | Path | None = None, hydra: bool = False):
    """Hydra's composition of `<name>.yaml` and the overrides, as an OmegaConf DictConfig (interpolations
    unresolved, not type-checked: load_config does both); `hydra=True` keeps Hydra's own `hydra` section
    (`--cfg hydra|all`)."""
    from hydra import compose

    return with_hydra(name, overrides, lambda o: compose(config_name=name, overrides=o, return_hydra_config=hydra),
                      configs_dir=configs_dir, extra_dir=extra_dir)


def with_hydra(name: str, overrides: list[str] | None, fn, *, configs_dir: Path = CONFIGS_DIR,
               extra_dir: str | Path | None = None):
    """`fn(hydra_overrides)` inside Hydra's context for `<name>.yaml`'s directories (the user's first): the
    overrides as Hydra takes them (`++key=value`; a group selection the config does not list gets `+`).
    Hydra's errors become ValueError."""
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    dirs = ([Path(extra_dir).expanduser().resolve()] if extra_dir else []) + [configs_dir]
    if not any((d / f"{name}.yaml").is_file() for d in dirs):
        found = sorted({c for d in dirs for c in available_configs(d)})
        raise ValueError(f"no config named {name!r} in {', '.join(map(str, dirs))}; available: {', '.join(found)}")
    groups = config_groups(dirs)
    overrides = [_upsert(o, groups) for o in overrides or []]
    if extra_dir:  # the built-in configs stay reachable by name from the user's directory
        overrides.append(f"hydra.searchpath=[file://{configs_dir}]")

    def _run(overrides: list[str]):
        with initialize_config_dir(config_dir=str(dirs[0]), version_base="1.3"):
            return fn(overrides)

    try:
        try:
            return _run(overrides)
        except HydraException as err:
            if "No match in the defaults list" not in str(err):
                raise
            # a config that does not list the group (one not built on ppo_tiny): add the selection,
            # applied after the config's own keys
            overrides = [f"+{o}" if o.partition("=")[0] in groups else o for o in overrides]
            return _run(overrides)
    except HydraException as err:
        raise ValueError(f"could not compose config {name!r} with overrides {overrides}: {err}") from err
