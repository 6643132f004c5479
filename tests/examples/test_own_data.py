"""examples/own_data: its files load as docs/data.md says, its reward scores, and it trains for 2 steps."""

import json
from pathlib import Path

import pytest

from rlframe.config import load_config, validate
from rlframe.data.dataset import parse_row, read_rows
from rlframe.rewards.manager import RewardManager
from rlframe.rewards.registry import RewardFnSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_data"


def config(overrides=()):
    # the yaml's paths are relative to the repository root, where the README's command runs
    files = [f"data.train_files=[{EXAMPLE / 'train.jsonl'}]", f"data.val_files=[{EXAMPLE / 'val.jsonl'}]",
             f"reward.function_path={EXAMPLE / 'reward.py'}"]
    return validate(load_config("own_data", files + list(overrides), extra_dir=EXAMPLE))


def test_rows_are_usable_and_disjoint():
    train, val = read_rows(EXAMPLE / "train.jsonl"), read_rows(EXAMPLE / "val.jsonl")
    assert (len(train), len(val)) == (200, 40)
    assert all(parse_row(r)[0] is None for r in train + val)
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in val}


def test_reward_scores_and_extras():
    mgr = RewardManager(fn_spec=RewardFnSpec(str(EXAMPLE / "reward.py")), max_error_fraction=0.5)
    res = mgr.compute(["80", "79", "x"], data_sources=["my_sums"] * 3, ground_truths=["80"] * 3)
    assert res.scores.tolist() == pytest.approx([1.0, 0.4, 0.0])
    assert res.metrics["reward/exact/mean"] == pytest.approx(1 / 3)
    assert res.metrics["reward/off_by/count"] == 2 and res.metrics["reward/errors"] == 0


def test_config_validates_without_a_model_path():
    cfg = config()
    assert cfg.data.task is None and cfg.model.path is None
    assert config(["data.task=countdown"]).data.task == "countdown"  # a tiny model is pre-trained on it too


@pytest.mark.slow
def test_example_trains_two_steps(tmp_path, ray_cluster):
    from rlframe.controller.run import run_training

    cfg = config(["trainer.total_steps=2", "trainer.val_every=2", "data.val_size=16", "trainer.loggers=[jsonl]",
                  "trainer.plot=false", "rollout.kv_cache_bytes=33554432", f"trainer.output_dir={tmp_path}"])
    summary = run_training(cfg, config_name="own_data")
    rows = [json.loads(l) for l in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("reward/exact/mean" in r and r["reward/errors"] == 0 for r in steps)
    assert "val/accuracy" in steps[-1]
