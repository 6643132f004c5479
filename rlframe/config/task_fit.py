"""What the config says of the tiny model and the task's prompts, checked before Ray starts.

Without `model.path` a run starts from the tiny model of `model.tiny_preset` pre-trained on its task
(`tiny_model_task`): the tool task (`tool_arithmetic`) only with the
BPE-tokenizer preset `agent` (its chat template), every other task only with a character-tokenizer
preset. And the tool task's prompts (a system message documenting the calculator tool, then the
question) are `tool_task.PROMPT_TOKENS` tokens under that tokenizer, so a `data.prompt_length` below
that skips every row of a split the task makes as too long. Both used to be found only once the
workers had started (pretrain._recipe, the dataset's "no usable rows").
"""

from __future__ import annotations

from rlframe.config.schema import RunConfig


def tiny_model_task(cfg: RunConfig) -> str:
    """The task the tiny model of a run without model.path is pre-trained on: data.task, or with
    data.task=null (own data files only) the preset's own: tool_arithmetic for the BPE-tokenizer
    preset 'agent', arithmetic for the others (the shipped demo model for the default preset)."""
    if cfg.data.task is not None:
        return cfg.data.task
    from rlframe.data.tiny_model import PRESETS

    shape = PRESETS.get(cfg.model.tiny_preset)
    return "tool_arithmetic" if shape is not None and shape.tokenizer == "bpe" else "arithmetic"


def task_fit_problems(cfg: RunConfig) -> list[str]:
    if cfg.model.path is not None:  # an own model: its tokenizer decides (the dataset counts what it skips)
        return []
    from rlframe.data.tiny_model import PRESETS
    from rlframe.data.tool_task import DATA_SOURCE as TOOL_TASK, PROMPT_TOKENS

    preset, shape, task = cfg.model.tiny_preset, PRESETS.get(cfg.model.tiny_preset), tiny_model_task(cfg)
    if shape is None:
        return []  # an unknown preset: the ranges name it
    out = []
    bpe = sorted(name for name, s in PRESETS.items() if s.tokenizer == "bpe")
    char = sorted(name for name, s in PRESETS.items() if s.tokenizer != "bpe")
    if task == TOOL_TASK and shape.tokenizer != "bpe":
        out.append(f"data.task={task} with model.tiny_preset={preset}: without model.path the run starts from the tiny "
                   f"model pre-trained on data.task, and the tool task needs the chat template of a BPE-tokenizer "
                   f"preset ({', '.join(bpe)}), which preset {preset!r} (a character tokenizer) has not; set "
                   f"model.tiny_preset={bpe[0]} (docs/agents.md), or another data.task for preset {preset!r}")
    elif task != TOOL_TASK and shape.tokenizer == "bpe":
        out.append(f"model.tiny_preset={preset} with data.task={task}: without model.path the run starts from the tiny "
                   f"model pre-trained on data.task, and preset {preset!r} (a BPE tokenizer with a chat template) is "
                   f"pre-trained on the tool task only; set data.task={TOOL_TASK} (with data.prompt_length>="
                   f"{PROMPT_TOKENS} and agent.enabled=true, docs/agents.md), or a character-tokenizer preset for "
                   f"{task} (model.tiny_preset={'demo' if 'demo' in char else char[0]}; one of {', '.join(char)})")
    elif task == TOOL_TASK and cfg.data.prompt_length < PROMPT_TOKENS:
        splits = [key for key, files in (("train", cfg.data.train_files), ("validation", cfg.data.val_files))
                  if files == []]  # the splits the task makes (files given are the user's own prompts)
        if cfg.data.task == TOOL_TASK and splits:
            out.append(f"data.prompt_length={cfg.data.prompt_length} is shorter than every prompt of data.task="
                       f"{TOOL_TASK} ({PROMPT_TOKENS} tokens with the {preset} preset's tokenizer: a system message "
                       f"documenting the calculator tool, then the question), so its {' and '.join(splits)} "
                       f"split{'s' if len(splits) > 1 else ''} would have no usable row (all skipped too_long); set data.prompt_length={PROMPT_TOKENS} "
                       "or more (docs/agents.md uses 128)")
    return out
