"""`algorithm=<name>` selects a whole algorithm (configs/algorithm/<name>.yaml): every file runs the
dry run on the default config, sets every key its algorithm depends on, and a name its keys
contradict is a config error."""

from pathlib import Path

import pytest
import yaml

from rlframe.config import ConfigError, load_config, validate
from rlframe.config.algorithms import ALGORITHMS
from rlframe.main import main

GROUP_DIR = Path(__file__).resolve().parents[2] / "configs" / "algorithm"
GROUPS = sorted(p.stem for p in GROUP_DIR.glob("*.yaml"))
# what each file must set, so that selecting it over another config leaves nothing of the other's
KEYS = {"name", "adv_estimator", "n_samples", "kl_in_reward", "use_kl_loss", "dynamic_sampling", "overlong_buffer_len"}
RL_KEYS = KEYS | {"policy_loss", "loss_agg_mode", "clip_ratio_low", "clip_ratio_high"}


def test_every_algorithm_has_a_group_file():
    assert set(GROUPS) == set(ALGORITHMS)


@pytest.mark.parametrize("name", GROUPS)
def test_group_sets_every_key_of_its_algorithm(name):
    text = (GROUP_DIR / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n")  # it sets the batch too, not only algorithm.*
    alg = yaml.safe_load(text)["algorithm"]
    missing = (KEYS if name == "sft" else RL_KEYS) - set(alg)
    assert not missing, f"configs/algorithm/{name}.yaml lacks {sorted(missing)}"
    assert alg["name"] == name


@pytest.mark.parametrize("name", GROUPS)
def test_group_dry_run_on_the_default_config(name, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main([f"algorithm={name}", "trainer.dry_run=true"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    cfg = validate(load_config("ppo_tiny", [f"algorithm={name}", "trainer.dry_run=true"]))
    alg = cfg.algorithm
    assert f"algorithm: {name} (advantage estimator {alg.adv_estimator}, {alg.n_samples} sample(s) per prompt" in out
    assert ("critic on" in out) == (name == "ppo")
    assert cfg.trainer.experiment == f"{name}_tiny"  # not the directory of the default PPO run


def test_dapo_by_group_is_dapo():
    cfg = validate(load_config("ppo_tiny", ["algorithm=dapo"]))
    a = cfg.algorithm
    assert (a.name, a.adv_estimator, a.n_samples, a.dynamic_sampling, a.clip_ratio_high, a.loss_agg_mode,
            a.use_kl_loss, a.overlong_buffer_len) == ("dapo", "grpo", 4, True, 0.28, "token-mean", False, 2)
    assert not cfg.uses_critic and cfg.data.train_batch_size * a.n_samples == cfg.actor.mini_batch_size


def test_group_replaces_the_algorithm_of_a_derived_config_and_keeps_its_layout():
    grpo = load_config("grpo_tiny")
    assert (grpo.algorithm.name, grpo.trainer.experiment, grpo.data.train_batch_size) == ("grpo", "grpo_tiny", 64)
    remax = validate(load_config("grpo_tiny", ["algorithm=remax"]))
    assert (remax.algorithm.name, remax.algorithm.adv_estimator, remax.algorithm.n_samples,
            remax.algorithm.use_kl_loss) == ("remax", "remax", 1, False)
    cluster = validate(load_config("grpo_qwen7b", ["algorithm=rloo", "trainer.dry_run=true"]))
    assert cluster.algorithm.adv_estimator == "rloo"
    assert (cluster.data.train_batch_size, cluster.actor.mini_batch_size, cluster.trainer.experiment) == (
        128, 256, "grpo_qwen7b")  # the cluster config's own keys still win


def test_a_key_override_still_applies_after_the_group():
    cfg = load_config("ppo_tiny", ["algorithm=dapo", "algorithm.clip_ratio_high=0.3", "data.train_batch_size=32"])
    assert cfg.algorithm.clip_ratio_high == 0.3 and cfg.data.train_batch_size == 32


def test_a_user_config_without_the_group_gets_it_added(tmp_path):
    (tmp_path / "mine.yaml").write_text("data:\n  train_batch_size: 32\n")
    cfg = load_config("mine", ["algorithm=grpo"], extra_dir=tmp_path)
    assert cfg.algorithm.name == "grpo" and cfg.algorithm.n_samples == 4


def test_unknown_group_lists_the_choices():
    with pytest.raises(ValueError, match=r"(?s)Could not find 'algorithm/grpoo'.*dapo"):
        load_config("ppo_tiny", ["algorithm=grpoo"])


@pytest.mark.parametrize("overrides,key", [
    ("algorithm.name=grpo", "algorithm.name=grpo contradicts algorithm.adv_estimator=gae"),
    ("algorithm.name=remax", "algorithm.name=remax contradicts algorithm.adv_estimator=gae"),
    ("algorithm=grpo algorithm.name=dapo", "algorithm.name=dapo contradicts algorithm.dynamic_sampling=false"),
    ("algorithm=grpo algorithm.name=gspo", "algorithm.name=gspo contradicts algorithm.policy_loss=ppo"),
    ("algorithm=grpo algorithm.name=dr_grpo algorithm.adv_estimator=dr_grpo",
     "algorithm.name=dr_grpo contradicts algorithm.loss_agg_mode=null"),
    ("algorithm=remax algorithm.adv_estimator=reinforce_plus_plus",
     "algorithm.name=remax contradicts algorithm.adv_estimator=reinforce_plus_plus"),
])
def test_a_name_its_keys_contradict_is_an_error(overrides, key, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError) as err:
        validate(load_config("ppo_tiny", overrides.split()))
    assert key in err.value.problems[0]
    name = key.split()[0].split("=")[1]
    assert f"algorithm={name} (configs/algorithm/{name}.yaml)" in err.value.problems[0]


def test_custom_algorithms_are_not_checked():
    cfg = validate(load_config("rft_tiny", ["trainer.dry_run=true"],
                               extra_dir=Path(__file__).resolve().parents[2] / "examples" / "custom_algorithm"))
    assert cfg.algorithm.name == "rft"
