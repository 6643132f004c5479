"""Driver-side preparation of a run: the model directory, task data, tokenizer and dataloaders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from rlframe.config.schema import RunConfig
from rlframe.config.task_fit import tiny_model_task


def cache_root(cfg: RunConfig) -> Path:
    from rlframe.data.pretrain import default_cache_dir

    return Path(cfg.model.cache_dir).expanduser() if cfg.model.cache_dir else default_cache_dir()


def model_path(cfg: RunConfig) -> str:
    """`model.path`, or the tiny model pre-trained on the run's task (shipped for the default recipe,
    else built once and cached). Its seed is PRETRAIN_SEED whatever `data.seed`: the seed of a run
    orders its prompts, it does not pick another starting model."""
    if cfg.model.path is not None:
        return str(Path(cfg.model.path).expanduser())
    from rlframe.data.pretrain import PRETRAIN_SEED, build_pretrained_model

    task = tiny_model_task(cfg)
    if cfg.data.task is None:  # own data only: say which model it starts from (docs/data.md)
        from rlframe.utils.console import say

        say(f"model: model.path is null, so the run starts from the tiny {cfg.model.tiny_preset!r} model "
            f"pre-trained on the {task} task (its tokenizer knows printable ASCII only); "
            "set model.path=DIR to start from your own model")
    return str(build_pretrained_model(preset=cfg.model.tiny_preset, task=task,
                                      seed=PRETRAIN_SEED, steps=cfg.model.tiny_pretrain_steps,
                                      cache_dir=cache_root(cfg)))


def model_line(cfg: RunConfig) -> str:
    """The start-up's `model:` line: model.path, or the tiny preset and where its weights come from (the
    repository's pre-trained copy, an earlier build cached on this machine, or a build now)."""
    if cfg.model.path is not None:
        return f"model: {cfg.model.path}"
    from rlframe.data.pretrain import PRETRAIN_SEED, pretrained_source

    task = tiny_model_task(cfg)
    source = pretrained_source(preset=cfg.model.tiny_preset, task=task, seed=PRETRAIN_SEED,
                               steps=cfg.model.tiny_pretrain_steps, cache_dir=cache_root(cfg))
    how = {"shipped": "shipped pre-trained", "cached": f"pre-trained on the {task} task earlier, cached in "
           f"{cache_root(cfg) / 'models'}", "build": f"built and pre-trained on the {task} task now, then cached"}[source]
    return f"model: tiny preset {cfg.model.tiny_preset!r} ({how})"


# Bump when the synthetic files change in a way data_settings does not capture.
# 2: the split is made with PRETRAIN_SEED, no longer with data.seed; settings.json beside the files.
DATA_FORMAT = 2
SETTINGS_FILE = "settings.json"


def data_settings(cfg: RunConfig) -> dict:
    """Everything that determines a synthetic task's files, recorded in their folder as settings.json.

    The split is fixed per task: made with PRETRAIN_SEED from the pre-training's own split sizes
    (arithmetic, tool_arithmetic), so the RL prompts are the ones the tiny model was pre-trained on
    and the test split stays held out from it. `data.seed` is not here: it only orders the prompts.
    """
    from rlframe.data.pretrain import PRETRAIN_SEED, TASKS, default_sft

    task = cfg.data.task
    out = {"format": DATA_FORMAT, "task": task, "split_seed": PRETRAIN_SEED,
           "train_size": cfg.data.train_size, "val_size": cfg.data.val_size}
    if task in TASKS:
        sft = default_sft(task)
        return {**out, "spec": asdict(TASKS[task]), "num_train": sft.num_train, "num_test": sft.num_test}
    raise ValueError(f"data.task={task!r} is not a synthetic task; use one of {', '.join(sorted(TASKS))}, "
                     "or set data.task=null and give data.train_files")


def task_files(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """Train/val files. Files the config lists are always used for their split (data.train_files
    for training, data.val_files for validation); a split with none comes from the synthetic task
    `data.task` when one is set (its splits generated once, cached in a folder whose settings.json
    must equal `data_settings(cfg)`, else it is rebuilt), and is empty otherwise. data.val_files=null
    asks for no validation: the validation split is then empty whatever the task."""
    no_val = cfg.data.val_files is None
    train, val = list(cfg.data.train_files), list(cfg.data.val_files or [])
    if cfg.data.task is None or (train and (val or no_val)):
        return train, val
    settings = data_settings(cfg)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    final = cache_root(cfg) / "data" / f"{cfg.data.task}-{key}"
    if recorded_settings(final) != settings:
        _write_task_files(cfg, settings, final)
    return train or [str(final / "train.parquet")], val or ([] if no_val else [str(final / "test.parquet")])


def data_origin(cfg: RunConfig) -> str | None:
    """One line saying where each split comes from when the config mixes files and a synthetic task
    (e.g. `data.train_files` given with the default `data.task`); None when it does not."""
    d = cfg.data
    if d.task is None or not (d.train_files or d.val_files or d.val_files is None):
        return None
    train = f"data.train_files ({len(d.train_files)} file(s))" if d.train_files else f"the {d.task} task's train split"
    val = ("no validation (data.val_files=null)" if d.val_files is None else "validating on "
           + (f"data.val_files ({len(d.val_files)} file(s))" if d.val_files else f"the {d.task} task's held-out split"))
    return (f"data: training on {train}, {val} (files given are used for their split; "
            f"data.task={d.task} fills a split without files)")


def recorded_settings(folder: Path) -> dict | None:
    """The settings.json of a cached data folder with both files; None if anything is missing or unreadable."""
    try:
        if (folder / "train.parquet").is_file() and (folder / "test.parquet").is_file():
            return json.loads((folder / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        pass
    return None


def _write_task_files(cfg: RunConfig, settings: dict, final: Path) -> None:
    """Write the splits and settings.json to a temp folder, then put it in place of `final` (a folder
    with other or missing settings is moved aside and deleted)."""
    from rlframe.data.synthetic import write_parquet

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    rows = synthetic_rows(cfg)
    write_parquet(rows["train"][: cfg.data.train_size], tmp / "train.parquet")
    write_parquet(rows["test"][: cfg.data.val_size], tmp / "test.parquet")
    (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True))
    if final.exists():
        stale = final.parent / f".{final.name}.stale.{os.getpid()}"
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:  # built concurrently by another run: theirs is identical if its settings are
        shutil.rmtree(tmp, ignore_errors=True)
        if recorded_settings(final) != settings:
            raise RuntimeError(f"cached task data {final} does not record the settings {settings}; "
                               "delete that folder and start the run again") from None


def synthetic_rows(cfg: RunConfig) -> dict[str, list[dict]]:
    """The task's train/test splits as `data_settings(cfg)` describes them (the same for every data.seed)."""
    from rlframe.data.pretrain import TASKS, task_rows
    from rlframe.data.tool_task import DATA_SOURCE as TOOL_TASK, tool_rows

    s = data_settings(cfg)
    sizes = {"num_train": s["num_train"], "num_test": s["num_test"], "seed": s["split_seed"]}
    if cfg.data.task == TOOL_TASK:  # products to compute with the calculator tool (agent.enabled)
        return tool_rows(spec=TASKS[TOOL_TASK], **sizes)
    return task_rows(cfg.data.task, **sizes)


def build_data(cfg: RunConfig, tokenizer):
    """(train dataloader, validation dataset) with prompts left-padded to data.prompt_length."""
    from rlframe.data.dataloader import StatefulDataLoader
    from rlframe.data.dataset import PromptDataset

    train_files, val_files = task_files(cfg)
    origin = data_origin(cfg)
    if origin:
        from rlframe.utils.console import say

        say(origin)
    train = PromptDataset(train_files, tokenizer=tokenizer, max_prompt_length=cfg.data.prompt_length)
    val = PromptDataset(val_files, tokenizer=tokenizer, max_prompt_length=cfg.data.prompt_length) if val_files else None
    loader = StatefulDataLoader(train, batch_size=cfg.data.train_batch_size, seed=cfg.data.seed,
                                pad_token_id=tokenizer.pad_token_id, pad_to=cfg.data.prompt_length)
    return loader, val
