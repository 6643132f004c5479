"""Config messages a new user meets in the first hour name what they set."""

from pathlib import Path

import pytest

from rlframe.config import ConfigError, load_config, validate

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "own_data" / "train.jsonl"


def test_remax_estimator_without_remax_name_is_named_by_its_key():
    overrides = ["algorithm.trainer=rlframe.controller.trainers.ppo:PPOTrainer", "algorithm.name=my_remax",
                 "algorithm.adv_estimator=remax", "agent.enabled=true"]
    with pytest.raises(ConfigError) as err:
        validate(load_config("ppo_tiny", overrides))
    assert "not available with algorithm.adv_estimator=remax" in str(err.value)
    assert "algorithm.name=remax" not in str(err.value)


def test_files_only_without_model_path_is_accepted():
    cfg = validate(load_config("grpo_tiny", ["data.task=null", f"data.train_files=[{TRAIN}]"]))
    from rlframe.controller.trainers.prepare import tiny_model_task

    assert tiny_model_task(cfg) == "arithmetic"
