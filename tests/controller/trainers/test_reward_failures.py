"""A reward that fails on most of a step's samples stops the run (exit code 1) with the first
traceback and the keys that set a reward function, instead of training on zeros."""

import json

import pytest

from rlframe.main import main
from rlframe.rewards.manager import RewardErrorsExceeded


def test_main_exits_1_with_the_message(monkeypatch, capsys):
    import rlframe.controller.run as run

    def failing(cfg, *, config_name=""):
        raise RewardErrorsExceeded(failed=3, total=4, max_error_fraction=0.5,
                                   first_traceback="Traceback (most recent call last):\nValueError: nope\n")

    monkeypatch.setattr(run, "run_training", failing)
    monkeypatch.setattr("rlframe.controller.cpu_precision.check_cpu_precision", lambda cfg: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rlframe: the reward function failed on 3 of 4 samples") and "ValueError: nope" in err
    assert "reward.function_path" in err and "reward.max_error_fraction=0.5" in err


@pytest.mark.slow
def test_an_unknown_data_source_stops_the_run_with_exit_code_1(tmp_path, capsys, ray_cluster):
    from tests.controller.trainers.test_end_to_end import COMMON

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{a}="}], "data_source": "my_data",
                                         "reward_model": {"ground_truth": str(2 * a), "style": "rule"}}) + "\n"
                             for a in range(10, 42)))
    code = main(["--config-name", "grpo_tiny", *COMMON, "data.train_batch_size=4", "algorithm.use_kl_loss=false",
                 "ref.enabled=false", "trainer.val_every=0", "trainer.export_hf=false", f"data.train_files=[{train}]",
                 f"trainer.output_dir={tmp_path}", "trainer.experiment=bad_reward"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "the reward function failed on 16 of 16 samples" in err
    assert err.count("no built-in reward for data_source 'my_data'") == 1  # the first traceback, once
    assert "reward.function_path" in err and "reward.function_name" in err and "custom_fn" not in err
