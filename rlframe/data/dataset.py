"""Prompt datasets from parquet or jsonl files in the verl layout.

A row: `prompt` = chat messages [{"role": ..., "content": ...}, ...] (a plain string is taken as one
user message), `data_source` (str, picks the reward function), `reward_model` =
{"ground_truth": ..., "style": "rule"}, optional `extra_info` (dict). The tokenizer's chat template
turns the messages into text (with the generation prompt), which is tokenized once at load.

Rows that cannot be used are skipped, not fatal: `malformed` (a jsonl line that is not valid UTF-8
or not JSON, missing or mistyped fields, e.g. every row of a parquet file with the wrong schema), `empty` (no message with non-blank content) and `too_long` (more prompt tokens than
`max_prompt_length`). `PromptDataset.skipped` counts them per reason with the first few row
numbers (0-based, per file) so the data can be fixed. A file with no usable row is an error that
names the file (and, for parquet, the columns its schema lacks); so is a file pyarrow cannot read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("rlframe.data")

REASONS = ("malformed", "empty", "too_long")
FIRST_ROWS_REPORTED = 5


@dataclass
class PromptRow:
    prompt_ids: list[int]
    raw_prompt: list[dict]
    data_source: str
    ground_truth: object
    extra_info: dict


@dataclass
class SkipReport:
    """Skipped rows of one load: counts and the first row numbers per reason, per file."""

    counts: dict[str, int] = field(default_factory=lambda: {r: 0 for r in REASONS})
    first_rows: dict[str, list[tuple[str, int]]] = field(default_factory=lambda: {r: [] for r in REASONS})
    notes: list[str] = field(default_factory=list)  # whole-file findings, e.g. a parquet schema's missing columns

    def add(self, reason: str, file: str, row: int) -> None:
        self.counts[reason] += 1
        if len(self.first_rows[reason]) < FIRST_ROWS_REPORTED:
            self.first_rows[reason].append((file, row))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        parts = [
            f"{reason}={n} (first rows: {', '.join(f'{Path(f).name}:{r}' for f, r in self.first_rows[reason])})"
            for reason, n in self.counts.items()
            if n
        ]
        return "skipped " + ("; ".join(parts + self.notes) if parts or self.notes else "nothing")


def read_rows(path: str | Path) -> list[object]:
    """Raw rows of a .parquet or .jsonl/.json-lines file; unparsable jsonl lines become None."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset file {str(path)!r} does not exist; check data.train_files / data.val_files")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix in (".jsonl", ".ndjson"):
        rows: list[object] = []
        with path.open("rb") as fh:  # decoded per line: one line of bad bytes must not end the load
            for raw in fh:
                try:
                    line = raw.decode("utf-8")
                    rows.append(json.loads(line) if line.strip() else None)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    rows.append(None)
        return rows
    raise ValueError(f"dataset file {str(path)!r} has suffix {suffix!r}; use .parquet or .jsonl")


def _read_parquet(path: Path) -> list[object]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:  # one file: ParquetFile reads it without pyarrow.dataset (and pandas), 0.2-0.4 s of imports
        return pq.ParquetFile(path).read().to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"dataset file {str(path)!r} cannot be read as parquet ({type(err).__name__}: {err}); "
                         "rewrite it with pyarrow/pandas, or remove it from data.train_files / data.val_files") from err


def missing_parquet_columns(path: str | Path, prompt_key: str = "prompt") -> list[str]:
    """Columns a verl-layout row needs that the parquet file's schema lacks."""
    import pyarrow.parquet as pq

    names = set(pq.read_schema(path).names)
    return [c for c in (prompt_key, "data_source", "reward_model") if c not in names]


def _messages(prompt) -> list[dict] | None:
    """Normalise the prompt field to a list of {role, content} dicts; None when malformed."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, (list, tuple)):
        return None
    out = []
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return out


def parse_row(row, *, prompt_key: str = "prompt") -> tuple[str | None, dict | None]:
    """(skip reason or None, normalised fields) of one raw row, before tokenization."""
    if not isinstance(row, dict):
        return "malformed", None
    messages = _messages(row.get(prompt_key))
    rm = row.get("reward_model")
    extra = row.get("extra_info")
    if (
        messages is None
        or not isinstance(row.get("data_source"), str)
        or not isinstance(rm, dict)
        or "ground_truth" not in rm
        or not (extra is None or isinstance(extra, dict))
    ):
        return "malformed", None
    if not any(m["content"].strip() for m in messages):
        return "empty", None
    fields = {"raw_prompt": messages, "data_source": row["data_source"], "ground_truth": rm["ground_truth"],
              "extra_info": dict(extra or {})}
    return None, fields


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat template with the generation prompt, then token ids (no extra special tokens)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


class PromptDataset:
    """Usable prompt rows of one or more files, tokenized; `skipped` reports the rest.

    Args:
        files: one path or a list of .parquet / .jsonl paths.
        tokenizer: a HF tokenizer with a chat template.
        max_prompt_length: rows with more prompt tokens are skipped (`too_long`).
    """

    def __init__(self, files, *, tokenizer, max_prompt_length: int, prompt_key: str = "prompt"):
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        files = [files] if isinstance(files, (str, Path)) else list(files)
        if not files:
            raise ValueError("no dataset files given; set data.train_files to a .parquet or .jsonl path")
        self.rows: list[PromptRow] = []
        self.skipped = SkipReport()
        for file in files:
            kept = self._load_file(str(file), tokenizer, max_prompt_length, prompt_key)
            if kept == 0:
                raise ValueError(
                    f"dataset file {str(file)!r} has no usable rows ({self.skipped.summary()}); "
                    f"each row needs '{prompt_key}' (chat messages), 'data_source' and "
                    "'reward_model': {'ground_truth': ...}, within max_prompt_length tokens"
                )
        if self.skipped.total:
            logger.warning("prompt dataset: %s", self.skipped.summary())

    def _load_file(self, file: str, tokenizer, max_len: int, prompt_key: str) -> int:
        kept = 0
        rows = read_rows(file)
        if file.lower().endswith(".parquet") and (missing := missing_parquet_columns(file, prompt_key)):
            self.skipped.notes.append(f"{Path(file).name}: its schema lacks columns {missing}, so every row is malformed")
        for i, raw in enumerate(rows):
            reason, fields = parse_row(raw, prompt_key=prompt_key)
            if reason is None:
                try:
                    ids = encode_prompt(tokenizer, fields["raw_prompt"])
                except Exception:  # noqa: BLE001 - a template error on one row skips that row
                    reason = "malformed"
                else:
                    reason = "too_long" if len(ids) > max_len else ("empty" if not ids else None)
            if reason is not None:
                self.skipped.add(reason, file, i)
                continue
            self.rows.append(PromptRow(prompt_ids=ids, **fields))
            kept += 1
        return kept

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]
