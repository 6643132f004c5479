"""What a run reads from this machine, checked by the validation before any worker starts (not in a
dry run, which checks a cluster config elsewhere): data files, model directories (and what the
megatron engine would refuse in them), a resume checkpoint, the weight format, reward models, the
reward function and tools file (imported, their signatures checked), the loggers' packages.
"""

from __future__ import annotations

from pathlib import Path

from rlframe.config.schema import RunConfig


def check_paths(cfg: RunConfig, out: list[str]) -> None:
    """Append what is wrong with what the run will read on this machine (outside a dry run)."""
    if cfg.data.task is None and not cfg.data.train_files:
        out.append("data.task is null and data.train_files is empty: give parquet/jsonl files or a synthetic task")
    for key in ("train_files", "val_files"):  # files given are used whatever data.task is, so they must exist
        for f in getattr(cfg.data, key) or []:  # val_files=null: no validation
            if not Path(f).expanduser().is_file():
                fix = ("or set data.task to a synthetic task" if cfg.data.task is None else
                       f"or remove it to use the {cfg.data.task} task's split (data.{key}=[])")
                out.append(f"data file {f!r} (data.{key}) does not exist; fix the path {fix}")
            elif Path(f).suffix.lower() not in (".parquet", ".jsonl", ".ndjson"):
                out.append(f"data file {f!r} (data.{key}) is neither .parquet nor .jsonl; convert it to one of "
                           "them (rows in the verl layout: rlframe/data/dataset.py)")
    for key, model_dir, fix in (
            ("model.path", cfg.model.path, "or set model.path=null to build the tiny model"),
            ("model.critic_path", cfg.model.critic_path if cfg.uses_critic else None,
             "or set model.critic_path=null to give the critic the actor's model with a value head")):
        if problem := _model_dir_problem(key, model_dir, fix, hf_config=cfg.model.hf_config is not None):
            out.append(problem)
    out.extend(_engine_model_problems(cfg))
    if cfg.reward.function_path is not None and not Path(cfg.reward.function_path).expanduser().is_file():
        out.append(f"reward.function_path={cfg.reward.function_path!r} does not exist; give the path of a "
                   ".py file that defines reward.function_name")
    elif cfg.reward.function_path is not None and cfg.reward.function_name.isidentifier():
        _check_reward_function(cfg, out)
    if cfg.agent.enabled:
        _check_tools_file(cfg, out)
    _check_logger_packages(cfg, out)
    resume = cfg.trainer.resume
    if resume not in ("auto", "off") and not Path(resume).expanduser().is_dir():
        out.append(f"trainer.resume={resume!r} is not 'auto', 'off' or an existing checkpoint directory; use "
                   "trainer.resume=auto to continue from the newest checkpoint of the run, or fix the path")
    elif resume not in ("auto", "off"):  # a damaged checkpoint fails here, before any worker starts
        from rlframe.utils.manifest import CheckpointDamaged, verify

        try:
            verify(Path(resume).expanduser())
        except CheckpointDamaged as err:
            out.append(f"trainer.resume={resume!r}: {err}")
    from rlframe.utils.model_files import check_weight_format

    for key, model_dir in (("model.path", cfg.model.path), ("model.critic_path", cfg.model.critic_path),
                           *((f"reward.model_paths[{i}]", p) for i, p in enumerate(cfg.reward.model_paths))):
        problem = model_dir and check_weight_format(key, model_dir, allow_pickle=cfg.model.allow_pickle_weights)
        if problem:
            out.append(problem)
    from rlframe.rewards.reward_model import check_reward_model_dir

    for i, rm_dir in enumerate(cfg.reward.model_paths):  # a sequence classifier with its tokenizer
        if problem := check_reward_model_dir(f"reward.model_paths[{i}]", rm_dir):
            out.append(problem)


def _engine_model_problems(cfg: RunConfig) -> list[str]:
    """What each role's engine would refuse in its model (architecture, tied embeddings, a layout that
    does not divide its shapes: the spec's check_model), read from config.json here instead of in
    every worker."""
    import json

    from rlframe.plugins import engine_spec
    from rlframe.resharding.formats import ModelDims

    out = []
    for name, role, model_dir, config_file in _role_model_configs(cfg):
        spec = engine_spec(role.strategy)
        if spec.check_model is None:
            continue
        try:
            spec.check_model(ModelDims.config_namespace(json.loads(config_file.read_text())), role, where=model_dir)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            layout = ", ".join(f"{name}.{d}={getattr(role, d)}" for d in ("dp", "tp", "pp", "sp") if getattr(role, d) > 1)
            out.append(f"{name} (strategy={role.strategy}{', ' + layout if layout else ''}): {err}")
    return out


def _role_model_configs(cfg: RunConfig):
    """(role name, role config, its model directory's config.json) of the actor and, with one, the critic."""
    for name, role, model_dir in (("actor", cfg.actor, cfg.model.path),
                                  ("critic", cfg.critic, (cfg.model.critic_path or cfg.model.path) if cfg.uses_critic else None)):
        config_file = Path(model_dir).expanduser() / "config.json" if model_dir else None
        if config_file is not None and config_file.is_file():
            yield name, role, str(model_dir), config_file


def _model_dir_problem(key: str, model_dir: str | None, fix: str, *, hf_config: bool) -> str | None:
    """What is wrong with a model directory the workers will load (None: nothing, or no directory set)."""
    if model_dir is None:
        return None
    p = Path(model_dir).expanduser()
    if (p / "config.json").is_file():
        return None
    what = "the directory does not exist" if not p.exists() else (
        "it is not a directory" if not p.is_dir() else "not an HF model directory")
    note = ("; model.hf_config stands in for config.json only in a dry run (trainer.dry_run=true)"
            if hf_config and key == "model.path" else "")
    return (f"{key}={model_dir!r} has no config.json ({what}){note}; point it at a local save_pretrained "
            f"directory (one holding config.json and the weights) on this machine, {fix}")


def _check_reward_function(cfg: RunConfig, out: list[str]) -> None:
    """Import the user's reward function now: a missing name or a wrong signature fails here, not
    in the first step's scoring (rlframe/rewards/registry.py)."""
    from rlframe.rewards.registry import load_reward_fn

    r = cfg.reward
    try:
        load_reward_fn(r.function_path, r.function_name)
    except ValueError as err:
        key = ("reward.function_path", r.function_path) if str(err).startswith("importing") else \
            ("reward.function_name", r.function_name)
        out.append(f"{key[0]}={key[1]!r}: {err}")


def _check_tools_file(cfg: RunConfig, out: list[str]) -> None:
    """Load agent.tools_path as the run will (rlframe.agents.tools.load_tools): the file exists and
    imports, and each tool's schema and signature fit; and each tool's timeout fits the trajectory budget."""
    from rlframe.agents.tools import BUILTIN_TOOLS, check_tool_budget, load_tools

    agent = cfg.agent
    builtin = tuple(n for n in agent.builtin_tools if n in BUILTIN_TOOLS)  # unknown names are reported apart
    try:
        tools = load_tools(agent.tools_path, builtin=builtin)
        check_tool_budget(tools, agent.max_tool_seconds_per_trajectory)
    except ValueError as err:
        key = "agent.tools_path" if agent.tools_path is not None else "agent.builtin_tools"
        value = agent.tools_path if agent.tools_path is not None else list(agent.builtin_tools)
        out.append(f"{key}={value!r}: {err}")


# trainer.loggers entries that need a package rlframe does not install, and the extra that does (setup.py).
LOGGER_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}


def _check_logger_packages(cfg: RunConfig, out: list[str]) -> None:
    import importlib.util

    for sink, package in LOGGER_PACKAGES.items():
        if sink in cfg.trainer.loggers and importlib.util.find_spec(package) is None:
            out.append(f"trainer.loggers={list(cfg.trainer.loggers)!r} names {sink}, but the {package} package is "
                       f"not installed; install it with `pip install -e .[{sink}]` (or `pip install {package}`), "
                       f"or remove {sink} from trainer.loggers")
