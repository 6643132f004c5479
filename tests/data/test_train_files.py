"""Files listed in data.train_files / data.val_files are what the run trains and validates on, also
while data.task is set (it is by default): the task only fills a split that lists no files."""

import json

import pytest

from rlframe.config import ConfigError, load_config, validate
from rlframe.config.schema import RunConfig
from rlframe.controller.trainers import prepare
from rlframe.data.tokenizer import build_char_tokenizer

PROBLEMS = [("11+22=", "33"), ("40+2=", "42"), ("5+5=", "10"), ("70+8=", "78")]


def _jsonl(path, problems, data_source="arithmetic"):
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}], "data_source": data_source,
                                        "reward_model": {"ground_truth": a, "style": "rule"}}) + "\n"
                            for q, a in problems))
    return str(path)


def _cfg(tmp_path, **data) -> RunConfig:
    cfg = RunConfig()
    cfg.model.cache_dir = str(tmp_path / "cache")
    cfg.data.train_batch_size = 2
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def _prompts(dataset) -> list[str]:
    return sorted(row.raw_prompt[-1]["content"] for row in dataset.rows)


def test_train_files_are_used_while_the_default_task_is_set(tmp_path, capsys):
    train = _jsonl(tmp_path / "train.jsonl", PROBLEMS)
    cfg = _cfg(tmp_path, train_files=[train])
    assert cfg.data.task == "arithmetic"  # the default
    loader, val = prepare.build_data(cfg, build_char_tokenizer())
    assert _prompts(loader.dataset) == sorted(q for q, _ in PROBLEMS)
    assert len(val) == cfg.data.val_size  # no val_files: the task's held-out split
    said = capsys.readouterr().out
    assert "training on data.train_files (1 file(s)), validating on the arithmetic task's held-out split" in said


def test_train_and_val_files_given_make_no_task_data(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", PROBLEMS)
    val = _jsonl(tmp_path / "val.jsonl", PROBLEMS[:1])
    cfg = _cfg(tmp_path, train_files=[train], val_files=[val])
    assert prepare.task_files(cfg) == ([train], [val])
    loader, val_set = prepare.build_data(cfg, build_char_tokenizer())
    assert len(loader.dataset) == 4 and _prompts(val_set) == ["11+22="]
    assert not (tmp_path / "cache").exists()  # nothing synthetic was generated


def test_val_files_alone_keep_the_task_for_training(tmp_path):
    val = _jsonl(tmp_path / "val.jsonl", PROBLEMS[:2])
    (train,), (got_val,) = prepare.task_files(_cfg(tmp_path, val_files=[val]))
    assert got_val == val and train.endswith("train.parquet") and str(tmp_path / "cache") in train


def test_no_files_and_no_task_mean_no_data():
    cfg = RunConfig()
    cfg.data.task = None
    assert prepare.task_files(cfg) == ([], [])


def test_config_checks_the_files_given_with_the_default_task(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError) as err:
        validate(load_config("ppo_tiny", ["data.train_files=[/no/such/train.jsonl]"]))
    assert "data file '/no/such/train.jsonl' (data.train_files) does not exist" in err.value.problems[0]
    assert "data.train_files=[]" in err.value.problems[0]
    csv = tmp_path / "train.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match=r"train.csv' \(data.train_files\) is neither .parquet nor .jsonl"):
        validate(load_config("ppo_tiny", [f"data.train_files=[{csv}]"]))
    # a small file: the synthetic task's data.train_size no longer bounds the batch
    small = _jsonl(tmp_path / "small.jsonl", PROBLEMS * 40)
    cfg = validate(load_config("ppo_tiny", [f"data.train_files=[{small}]", "data.train_size=100"]))
    assert cfg.data.train_files == [small]


def test_val_files_null_means_no_validation(tmp_path, monkeypatch, capsys):
    """docs/data.md: `data.val_files=null` is no validation, whatever data.task (it was refused "must
    not be null"); `[]` stays "no files" (the task's held-out split)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    train = _jsonl(tmp_path / "train.jsonl", PROBLEMS * 32)
    cfg = validate(load_config("ppo_tiny", ["data.val_files=null", f"data.train_files=[{train}]",
                                            f"model.cache_dir={tmp_path / 'cache'}"]))
    assert cfg.data.val_files is None
    loader, val = prepare.build_data(cfg, build_char_tokenizer())
    assert val is None and len(loader.dataset) == 128
    assert "no validation (data.val_files=null)" in capsys.readouterr().out
    # with the task's train split too: its held-out split is not made either, and data.val_size does not matter
    cfg = validate(load_config("ppo_tiny", ["data.val_files=null", "data.val_size=100000", "trainer.dry_run=true"]))
    (task_train,), no_val = prepare.task_files(_cfg(tmp_path, val_files=None))
    assert task_train.endswith("train.parquet") and no_val == []
    assert prepare.task_files(_cfg(tmp_path, val_files=[]))[1][0].endswith("test.parquet")
