"""Hydra's own flags for the main job and preflight: `--cfg job|hydra|all` (with `--resolve`) and `--info`.

rlframe composes its configs with Hydra's compose API (load.py) rather than running as a `@hydra.main`
application, so these print Hydra's composition and start nothing:

    python -m rlframe.main --cfg job algorithm=dapo      # the composed config, as YAML
    python -m rlframe.main --cfg job --resolve           # with ${...} interpolations resolved
    python -m rlframe.main --info defaults               # where each part of the config comes from
"""

from __future__ import annotations

from pathlib import Path

INFO_KINDS = ("all", "config", "defaults", "searchpath")

HYDRA_NOTE = ("# Hydra's own section, as Hydra composes it. rlframe uses Hydra's compose API, not\n"
              "# @hydra.main: of this section only hydra.searchpath applies; the run directory is\n"
              "# trainer.output_dir/trainer.experiment_name and logging is rlframe's own (hydra.run,\n"
              "# hydra.job_logging, ... have no effect).\n")


def _yaml(cfg, *, resolve: bool) -> str:
    from omegaconf import OmegaConf

    if not resolve:
        return OmegaConf.to_yaml(cfg)
    try:
        return OmegaConf.to_yaml(cfg, resolve=True)
    except Exception as err:  # noqa: BLE001  (Hydra's section holds values only a @hydra.main run sets)
        return f"# --resolve: not resolvable here ({type(err).__name__}: {str(err).splitlines()[0]}); unresolved:\n" + \
            OmegaConf.to_yaml(cfg)


def config_choices(dirs: list[Path]) -> list[str]:
    """The configs (--config-name) and config groups (GROUP=NAME) of these directories, a line each."""
    from rlframe.config.load import available_configs, config_groups

    out = ["Configs (--config-name): " + ", ".join(sorted({c for d in dirs for c in available_configs(d)}))]
    for group in sorted(config_groups(dirs)):
        choices = sorted({c for d in dirs for c in available_configs(d / group)})
        out.append(f"Config group {group} ({group}=NAME): {', '.join(choices)}")
    return out


def config_text(name: str, overrides: list[str], config_path: str | None, *, cfg: str, resolve: bool) -> str:
    """`--cfg job`: the composed config (what load_config type-checks; `trainer.dry_run=true` then validates
    it); `--cfg hydra`: Hydra's own `hydra` section; `--cfg all`: both."""
    from omegaconf import OmegaConf

    from rlframe.config.load import compose_config

    composed = compose_config(name, overrides, extra_dir=config_path, hydra=cfg != "job")
    if cfg == "job":
        return _yaml(composed, resolve=resolve)
    hydra_part = HYDRA_NOTE + _yaml(OmegaConf.masked_copy(composed, ["hydra"]), resolve=resolve)
    if cfg == "hydra":
        return hydra_part
    with_hydra = OmegaConf.masked_copy(composed, [k for k in composed if k != "hydra"])
    return _yaml(with_hydra, resolve=resolve) + hydra_part


def info_text(name: str, overrides: list[str], config_path: str | None, *, kind: str = "all",
              resolve: bool = False) -> str:
    """`--info [all|config|defaults|searchpath]`: Hydra's version, the config search path, the defaults list
    (which file gives each part of the config, in the order they are merged) and the composed config."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from rlframe.config.load import CONFIGS_DIR, compose_config, with_hydra

    out = [f"Hydra {hydra.__version__} (compose API); config {name!r}, overrides {overrides or []}"]
    if kind in ("all", "searchpath"):
        def sources(_):
            return [(s.provider, s.path) for s in GlobalHydra.instance().config_loader().get_sources()]

        out += ["", "Config search path (provider: path, first match wins):"]
        found = with_hydra(name, overrides, sources, extra_dir=config_path)
        out += [f"  {provider}: {path}" for provider, path in found if path]
        if config_path:  # load.py adds it as hydra.searchpath, applied while composing
            out.append(f"  file: {CONFIGS_DIR} (hydra.searchpath: the built-in configs)")
        dirs = ([Path(config_path).expanduser().resolve()] if config_path else []) + [CONFIGS_DIR]
        out += ["", *config_choices(dirs)]
    if kind in ("all", "defaults"):
        def defaults(o):
            return GlobalHydra.instance().config_loader().compute_defaults_list(name, o, RunMode.RUN).defaults

        out += ["", "Defaults list (merged in this order; later files override earlier ones):",
                f"  {'config':<28} {'package':<10} parent"]
        for d in with_hydra(name, overrides, defaults, extra_dir=config_path):
            if not (d.config_path or "").startswith("hydra/") and d.parent != "hydra/config":
                out.append(f"  {d.config_path:<28} {d.package or '_global_':<10} {d.parent}")
    if kind in ("all", "config"):
        out += ["", "Config:", _yaml(compose_config(name, overrides, extra_dir=config_path), resolve=resolve).rstrip()]
    return "\n".join(out)
