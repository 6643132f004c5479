"""The custom-algorithm example runs end to end and learns; registration errors are clear."""

import json
from pathlib import Path

import pytest
import torch

from rlframe.algos import get_advantage_estimator, register_advantage_estimator
from rlframe.config import ConfigError, load_config, validate
from rlframe.single_controller import register
from rlframe.controller.run import run_training
from tests.controller.trainers.test_end_to_end import COMMON

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_algorithm"


def test_estimator_picks_best_correct_sample_per_group():
    import examples.custom_algorithm.rft  # noqa: F401  (registers)

    fn = get_advantage_estimator("rft_best_of_n")
    rewards = torch.zeros(4, 3)
    rewards[:, 1] = torch.tensor([0.0, 1.0, 1.0, 0.0])  # group a: rows 0,1 ; group b: rows 2,3
    mask = torch.ones(4, 3)
    adv, _ = fn(token_level_rewards=rewards, response_mask=mask, index=["a", "a", "b", "b"])
    assert adv.sum(-1).tolist() == [0.0, 3.0, 3.0, 0.0]


def test_duplicate_name_is_rejected():
    import examples.custom_algorithm.rft  # noqa: F401

    with pytest.raises(ValueError, match="'rft_best_of_n' is already registered"):
        @register_advantage_estimator("rft_best_of_n")
        def again(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
                  gamma=1.0, lam=1.0, epsilon=1e-6):
            return token_level_rewards, token_level_rewards


def test_unknown_dispatch_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown dispatch mode 'broadcast_all'; known modes"):
        register(dispatch="broadcast_all")


def test_bad_class_path_fails_validation():
    with pytest.raises(ConfigError, match="algorithm.trainer: cannot load 'examples.nope:Trainer'"):
        validate(load_config("rft_tiny", ["algorithm.trainer=examples.nope:Trainer"], extra_dir=EXAMPLE))


@pytest.mark.slow
def test_example_runs_and_learns(tmp_path, ray_cluster):
    cfg = validate(load_config("rft_tiny", COMMON + [
        "data.train_batch_size=8", "actor.mini_batch_size=32", "trainer.total_steps=3", "trainer.val_every=3", f"trainer.output_dir={tmp_path}"],
        extra_dir=EXAMPLE))
    summary = run_training(cfg, config_name="rft_tiny")
    rows = [json.loads(l) for l in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["step"] >= 1]
    assert all("rft/accept_ratio" in r and "timing_s/response_nll" in r for r in train)
    learned = [r for r in train if "rft/accepted_nll_before" in r]
    assert learned, "no sample was ever accepted: nothing to learn from"
    # each step makes the answers it accepted more likely under the policy (the RAFT objective)
    pairs = [(r["rft/accepted_nll_before"], r["rft/accepted_nll_after"]) for r in learned]
    # One optimizer step per batch: the first (fresh AdamW: a descent direction) must lower the NLL of
    # the answers it accepted, and so must the steps on average (the RAFT objective).
    assert pairs[0][1] < pairs[0][0], pairs
    assert sum(a for _, a in pairs) < sum(b for b, _ in pairs), pairs
