"""Driver-side preparation of a run: the model directory, task data, tokenizer and dataloaders."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from rlframe.config.schema import RunConfig


def cache_root(cfg: RunConfig) -> Path:
    from rlframe.data.pretrain import default_cache_dir

    return Path(cfg.model.cache_dir).expanduser() if cfg.model.cache_dir else default_cache_dir()


def model_path(cfg: RunConfig) -> str:
    """`model.path`, or the tiny model pre-trained on the run's task (built once, then cached)."""
    if cfg.model.path is not None:
        return str(Path(cfg.model.path).expanduser())
    from rlframe.data.pretrain import build_pretrained_model

    return str(build_pretrained_model(preset=cfg.model.tiny_preset, task=cfg.data.task or "arithmetic",
                                      seed=cfg.data.seed, steps=cfg.model.tiny_pretrain_steps,
                                      cache_dir=cache_root(cfg)))


def task_files(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """Train/val files: the configured ones, or the synthetic task's splits (generated once)."""
    if cfg.data.task is None:
        return list(cfg.data.train_files), list(cfg.data.val_files)
    from rlframe.data.synthetic import write_parquet

    spec = {"task": cfg.data.task, "train": cfg.data.train_size,
            "val": cfg.data.val_size, "seed": cfg.data.seed}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    final = cache_root(cfg) / "data" / f"{cfg.data.task}-{key}"
    if not (final / "test.parquet").exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        rows = synthetic_rows(cfg)
        write_parquet(rows["train"][: cfg.data.train_size], tmp / "train.parquet")
        write_parquet(rows["test"][: cfg.data.val_size], tmp / "test.parquet")
        try:
            os.rename(tmp, final)
        except OSError:  # built concurrently by another run: theirs is identical
            pass
    return [str(final / "train.parquet")], [str(final / "test.parquet")]


def synthetic_rows(cfg: RunConfig) -> dict[str, list[dict]]:
    """The task's splits. Arithmetic and tool_arithmetic use the pre-training's own spec, seed and
    split sizes, so the RL prompts are the ones the tiny model was pre-trained on and the test split
    stays held out."""
    from rlframe.data.pretrain import DEFAULT_SFT, TASKS, SFTConfig
    from rlframe.data.synthetic import arithmetic_rows, countdown_rows
    from rlframe.data.tool_task import DATA_SOURCE as TOOL_TASK, tool_rows

    if cfg.data.task == TOOL_TASK:  # products to compute with the calculator tool (agent.enabled)
        sft = DEFAULT_SFT[TOOL_TASK]
        return tool_rows(num_train=sft.num_train, num_test=sft.num_test, spec=TASKS[TOOL_TASK], seed=cfg.data.seed)
    if cfg.data.task in TASKS:
        sft = SFTConfig()
        return arithmetic_rows(num_train=sft.num_train, num_test=sft.num_test, spec=TASKS[cfg.data.task],
                               seed=cfg.data.seed)
    if cfg.data.task == "countdown":
        return countdown_rows(num_train=cfg.data.train_size, num_test=cfg.data.val_size, seed=cfg.data.seed)
    raise ValueError(f"data.task={cfg.data.task!r} is not a synthetic task; use arithmetic, countdown or {TOOL_TASK}, "
                     "or set data.task=null and give data.train_files")


def build_data(cfg: RunConfig, tokenizer):
    """(train dataloader, validation dataset) with prompts left-padded to data.prompt_length."""
    from rlframe.data.dataloader import StatefulDataLoader
    from rlframe.data.dataset import PromptDataset

    train_files, val_files = task_files(cfg)
    train = PromptDataset(train_files, tokenizer=tokenizer, max_prompt_length=cfg.data.prompt_length)
    val = PromptDataset(val_files, tokenizer=tokenizer, max_prompt_length=cfg.data.prompt_length) if val_files else None
    loader = StatefulDataLoader(train, batch_size=cfg.data.train_batch_size, seed=cfg.data.seed,
                                pad_token_id=tokenizer.pad_token_id, pad_to=cfg.data.prompt_length)
    return loader, val
