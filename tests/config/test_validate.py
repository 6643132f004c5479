"""Configuration errors are caught in the driver, before any worker starts, with a fix in the text."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlframe.config import ConfigError, load_config, validate


def problems(*overrides):
    with pytest.raises(ConfigError) as err:
        validate(load_config("ppo_tiny", list(overrides)))
    return str(err.value)


def test_default_config_is_valid():
    cfg = validate(load_config("ppo_tiny"))
    assert cfg.algorithm.name == "ppo" and cfg.uses_critic and cfg.uses_ref  # ref only reports KL


def test_batch_not_divisible_by_world_size():
    msg = problems("data.train_batch_size=63")
    assert "63 samples is not divisible by actor.dp=2; make it a multiple of 2" in msg


def test_generation_tp_larger_than_group():
    assert "rollout.tp=4 is larger than the actor group (2 processes); use rollout.tp <= 2" in problems("rollout.tp=4")


def test_missing_model_path():
    msg = problems("model.path=/no/such/model")
    assert "model.path='/no/such/model' has no config.json" in msg and "model.path=null" in msg


def test_unknown_algorithm_and_estimator():
    msg = problems("algorithm.name=ppo2", "algorithm.adv_estimator=gea")
    assert "algorithm.name='ppo2' is unknown; choose one of ppo, grpo" in msg
    assert "algorithm.adv_estimator='gea' is not registered; known: " in msg


def test_group_estimator_needs_samples():
    assert "algorithm.n_samples must be >= 2" in problems("algorithm.adv_estimator=grpo")


def test_layout_must_fit_processes():
    assert "actor layout dp(2) * tp(2) * pp(1) = 4 != its 2 processes" in problems("actor.tp=2")


def test_typo_in_key_suggests_the_right_one():
    with pytest.raises(ValueError, match="unknown config key actor.lrr; did you mean lr"):
        load_config("ppo_tiny", ["actor.lrr=1e-4"])


def test_megatron_runs_on_cpu():
    validate(load_config("ppo_tiny", ["actor.strategy=megatron", "critic.strategy=megatron"]))


MAIN_CASES = [
    ("data.train_batch_size=63", "not divisible"),
    ("rollout.tp=4", "larger than the actor group"),
    ("model.path=/nope", "no config.json"),
    ("algorithm.name=foo", "is unknown"),
]


@pytest.fixture(scope="module", autouse=True)
def main_runs(request):
    """The `python -m rlframe.main OVERRIDE` runs of the selected MAIN_CASES, {override: future}: started
    when the module's first test starts, two at a time in background threads, so that they overlap the
    in-process tests (each still a process of its own, with this process's environment); each test waits
    for its own. All have ended when the module's tests have."""
    selected = {item.callspec.params["override"] for item in request.session.items
                if getattr(item, "module", None) is request.module
                and getattr(item, "originalname", None) == "test_main_fails_fast_before_workers"}
    env, cwd = dict(os.environ), os.getcwd()
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {override: pool.submit(subprocess.run, [sys.executable, "-m", "rlframe.main", override],
                                     capture_output=True, text=True, timeout=60, env=env, cwd=cwd)
               for override, _ in MAIN_CASES if override in selected}


@pytest.mark.parametrize("override,expect", MAIN_CASES)
def test_main_fails_fast_before_workers(override, expect, main_runs):
    proc = main_runs[override].result()
    assert proc.returncode == 2, proc.stderr
    assert expect in proc.stderr
    assert "Started a local Ray" not in proc.stderr  # no worker (not even Ray) was started


def test_colocated_megatron_roles_share_tp_and_pp():
    msg = problems("actor.strategy=megatron", "critic.strategy=megatron", "resources.use_gpu=true",
                   "actor.tp=2", "actor.dp=1", "critic.tp=1")
    assert "colocated megatron roles use different (tp, pp) [(1, 1), (2, 1)]" in msg


def test_sequence_parallel_is_megatron_only():
    assert ("actor.sequence_parallel=true: strategy=fsdp has no sequence parallelism inside tp (strategy=megatron "
            "supports it)") in problems("actor.sequence_parallel=true")
