"""Engine registry, config validation and early layout checks (no processes needed)."""

import pytest

from rlframe.plugins import EngineSpec, engine_spec
from rlframe.workers.engines import TrainEngine, TrainEngineConfig, get_train_engine, register_train_engine
from rlframe.workers.engines.base import as_tensor_dict
from rlframe.workers.engines.fsdp.parallelize import check_model_fits


def test_registry_returns_the_fsdp_backend_and_names_the_choices():
    cls = get_train_engine("fsdp")
    assert issubclass(cls, TrainEngine) and cls.__name__ == "FSDPTrainEngine"
    with pytest.raises(ValueError, match=r"strategy='jax' is not a registered training engine; known: fsdp, megatron"):
        get_train_engine("jax")
    with pytest.raises(ValueError, match="takes an EngineSpec"):
        register_train_engine("bad")
    with pytest.raises(ValueError, match=r"'fsdp' is already registered"):
        register_train_engine(EngineSpec(name="fsdp", target="x.y:Z"))


def test_engine_specs_agree_with_their_engines():
    """The specs (no torch) state what the engines' own modules define."""
    from rlframe.workers.engines.lora import SUPPORTED_TARGETS
    from rlframe.workers.engines.megatron.model import SUPPORTED_MODEL_TYPES

    assert set(engine_spec("fsdp").lora_targets) == set(SUPPORTED_TARGETS)
    assert engine_spec("megatron").model_types == SUPPORTED_MODEL_TYPES and not engine_spec("megatron").lora


@pytest.mark.parametrize("kwargs, match", [
    ({"head": "reward"}, "engine head 'reward' is unknown"),
    ({"tp": 0}, r"dp \(1\), sp \(1\), tp \(0\) and pp \(1\) must be >= 1"),
    ({"lr_schedule": "cosine", "total_steps": 5, "warmup_steps": 5}, r"total_steps \(5\) > warmup_steps \(5\)"),
    ({"max_tokens_per_micro_batch": 0}, "max_tokens_per_micro_batch must be >= 1"),
    ({"grad_clip": -1.0}, "grad_clip must be > 0 or None"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainEngineConfig(model_path="x", **kwargs)


def test_model_that_does_not_split_over_tp_fails_with_the_arithmetic():
    from rlframe.data.tiny_model import PRESETS, make_config
    from rlframe.data.tokenizer import build_char_tokenizer

    cfg = make_config(PRESETS["test"], build_char_tokenizer())  # 4 heads, 2 kv heads, vocab 100
    check_model_fits(cfg, tp=2, model_type_path="test")
    with pytest.raises(ValueError, match=r"num_attention_heads=4 % tp\(3\) = 1.*num_key_value_heads=2 % tp\(3\) = 2"):
        check_model_fits(cfg, tp=3, model_type_path="test")
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 % tp\(4\) = 2"):
        check_model_fits(cfg, tp=4, model_type_path="test")


def test_batches_as_dicts_or_objects_with_a_batch_attribute():
    class Proto:
        batch = {"input_ids": 1}

    assert as_tensor_dict(Proto()) == {"input_ids": 1}
    with pytest.raises(ValueError, match="dict of tensors or have a `.batch` TensorDict"):
        as_tensor_dict([1, 2])


def test_frozen_engine_refuses_to_train():
    from rlframe.workers.engines.base import check_trainable

    check_trainable(TrainEngineConfig(model_path="m"))
    with pytest.raises(ValueError, match="train_step on a frozen engine"):
        check_trainable(TrainEngineConfig(model_path="m", frozen=True))


def test_attention_falls_back_to_sdpa_without_gpu_or_flash_attn():
    from rlframe.workers.engines.fsdp.modeling import resolve_attn_implementation

    assert resolve_attn_implementation("auto", on_gpu=False) == "sdpa"
    assert resolve_attn_implementation("eager", on_gpu=False) == "eager"
    with pytest.raises(ValueError, match="needs a GPU and the flash-attn package"):
        resolve_attn_implementation("flash_attention_2", on_gpu=False)
