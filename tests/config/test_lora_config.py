"""LoRA settings in the run config: checked in the driver, and handed to the training engine."""

import pytest

from rlframe.config import ConfigError, load_config, validate


@pytest.mark.parametrize("overrides, text", [
    ("actor.lora_rank=-1", "actor.lora_rank=-1 is out of range: it must be >= 0"),
    ("actor.lora_rank=8 actor.lora_alpha=0", "actor.lora_alpha=0"),
    ("actor.lora_rank=8 actor.lora_dropout=1.0", "actor.lora_dropout=1.0"),
    ("actor.lora_rank=8 actor.strategy=megatron", "LoRA is not supported with strategy=megatron"),
    ("actor.lora_rank=8 actor.lora_target_modules=[q_proj,qkv_proj]", "['qkv_proj']"),
    ("critic.lora_rank=8 critic.lora_target_modules=[]", "critic.lora_target_modules is empty"),
])
def test_bad_lora_settings_are_refused(overrides, text):
    with pytest.raises(ConfigError) as err:
        validate(load_config("ppo_tiny", overrides.split()))
    assert any(text in p for p in err.value.problems), err.value.problems


def test_lora_targets_match_the_engine():
    from rlframe.plugins import engine_spec
    from rlframe.workers.engines.lora import SUPPORTED_TARGETS

    assert sorted(engine_spec("fsdp").lora_targets) == sorted(SUPPORTED_TARGETS)


def test_lora_settings_reach_the_engine_config():
    from rlframe.workers.engines import TrainEngineConfig

    cfg = validate(load_config("ppo_tiny", "actor.lora_rank=8 actor.lora_alpha=32 "
                                           "actor.lora_target_modules=[q_proj,v_proj]".split()))
    role = cfg.actor
    engine_cfg = TrainEngineConfig(model_path="unused", lora_rank=role.lora_rank, lora_alpha=role.lora_alpha,
                                   lora_target_modules=role.lora_target_modules, lora_dropout=role.lora_dropout)
    assert engine_cfg.lora.scaling == 4.0 and engine_cfg.lora.target_modules == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="lora_rank=-2 must be >= 0"):
        TrainEngineConfig(model_path="unused", lora_rank=-2)
    with pytest.raises(ValueError, match="not projections the fsdp engine can adapt"):
        TrainEngineConfig(model_path="unused", lora_rank=4, lora_target_modules=("lm_head",))
