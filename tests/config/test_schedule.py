"""The learning-rate schedule counts optimizer steps: one per mini-batch, per epoch, per trainer step."""

import pytest

from rlframe.config import load_config, validate
from rlframe.config.schedule import optimizer_steps
from rlframe.controller.trainers.roles import role_specs
from rlframe.workers.engines.optim import lr_lambda


def test_engines_get_the_optimizer_step_count():
    cfg = validate(load_config("grpo_qwen7b", ["trainer.dry_run=true"]))
    # 128 prompts x 8 samples in mini-batches of 256: 4 optimizer steps per trainer step
    assert optimizer_steps(cfg, cfg.actor) == 4 * cfg.trainer.total_steps
    specs = role_specs(cfg, actor_path="unused", critic_path="unused")
    total = specs["actor"].kwargs["total_steps"]
    assert total == 4 * cfg.trainer.total_steps
    # a cosine schedule a quarter of the way through the run is still near its peak, and not 0 at the end
    quarter = lr_lambda(total // 4, schedule="cosine", warmup_steps=0, total_steps=total, min_lr_ratio=0.0)
    assert quarter > 0.8


def test_the_critic_counts_its_own_epochs_and_mini_batches():
    cfg = validate(load_config("ppo_tiny", ["critic.ppo_epochs=3", "critic.mini_batch_size=64"]))
    specs = role_specs(cfg, actor_path="unused", critic_path="unused")
    assert specs["actor"].kwargs["total_steps"] == cfg.trainer.total_steps  # 1 epoch of one 128-row mini-batch
    assert specs["critic"].kwargs["total_steps"] == cfg.trainer.total_steps * 3 * 2


def test_warmup_is_validated_against_optimizer_steps():
    from rlframe.config import ConfigError

    # 2 steps x 2 mini-batches = 4 optimizer steps: a warm-up of 3 leaves room, 4 does not
    base = ["trainer.total_steps=2", "actor.lr_schedule=cosine", "actor.mini_batch_size=64"]
    validate(load_config("ppo_tiny", base + ["actor.warmup_steps=3"]))
    with pytest.raises(ConfigError, match="4 optimizer steps"):
        validate(load_config("ppo_tiny", base + ["actor.warmup_steps=4"]))
