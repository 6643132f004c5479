"""The vLLM engine's arguments on GPU and CPU, checked on the CPU: what a first GPU run would
otherwise find by crashing (vLLM's custom all-reduce with one visible GPU per actor, a vLLM of
another release), the GPU defaults of CUDA graphs and prefix caching, the user's engine keywords, and
when the engine starts with dummy weights or drops its weights in a sleep."""

import dataclasses

import pytest
import torch

from rlframe.config import load_config, validate
from rlframe.workers.common import rollout_config, rollout_load_format
from rlframe.workers.rollout.vllm_adapt import check_vllm_version, gpu_kwargs, llm_kwargs, sleep_level


def test_tensor_parallel_on_gpu_turns_vllms_custom_all_reduce_off():
    assert gpu_kwargs(2, is_cpu=False) == {"disable_custom_all_reduce": True}
    assert gpu_kwargs(8, is_cpu=False) == {"disable_custom_all_reduce": True}
    assert gpu_kwargs(1, is_cpu=False) == {} and gpu_kwargs(2, is_cpu=True) == {}


@pytest.mark.parametrize("installed", ["0.32.0", "0.32.0+cpu", "0.32.1", "0.32"])
def test_the_pinned_vllm_release_is_accepted(installed):
    check_vllm_version(installed)


@pytest.mark.parametrize("installed", ["0.11.0", "0.33.0", "0.3.2"])
def test_another_vllm_release_is_refused_with_what_to_install(installed):
    with pytest.raises(RuntimeError, match=rf"needs vLLM 0\.32\.x .* imports vLLM {installed}\. .*vllm==0\.32\.0"):
        check_vllm_version(installed)


def engine_config(*overrides, on_gpu):
    cfg = validate(load_config("grpo_tiny", list(overrides)))
    return rollout_config(cfg.rollout, max_model_len=64, seed=0, compute_dtype=torch.float32, on_gpu=on_gpu)


def test_cuda_graphs_and_prefix_caching_are_on_by_default_on_gpu_only():
    gpu, cpu = engine_config(on_gpu=True), engine_config(on_gpu=False)
    assert (gpu.enforce_eager, gpu.enable_prefix_caching) == (False, True)
    assert (cpu.enforce_eager, cpu.enable_prefix_caching) == (True, False)
    forced = engine_config("rollout.enforce_eager=true", "rollout.enable_prefix_caching=false", on_gpu=True)
    assert (forced.enforce_eager, forced.enable_prefix_caching) == (True, False)


def test_engine_kwargs_reach_the_engine_and_owned_keys_are_refused():
    from rlframe.config import ConfigError

    assert engine_config("rollout.engine_kwargs={cpu_offload_gb: 2}", on_gpu=True).vllm_kwargs == {"cpu_offload_gb": 2}
    with pytest.raises(ConfigError, match=r"rollout.engine_kwargs.tensor_parallel_size is set by rlframe from rollout.tp"):
        engine_config("rollout.engine_kwargs={tensor_parallel_size: 4}", on_gpu=True)
    with pytest.raises(ConfigError, match=r"rollout.engine_kwargs.disable_custom_all_reduce is set by rlframe"):
        engine_config("rollout.engine_kwargs={disable_custom_all_reduce: false}", on_gpu=True)


def test_every_engine_keyword_rlframe_sets_is_owned():
    """rollout.engine_kwargs may not override what llm_kwargs derives (the list in the vLLM backend's spec)."""
    from rlframe.workers.rollout.config import RolloutConfig
    from rlframe.workers.rollout.vllm_spec import OWNED_ENGINE_KWARGS as ENGINE_KWARGS_OWNED

    for is_cpu in (True, False):
        config = RolloutConfig(backend="vllm", lora_rank=8, block_size=32, max_num_batched_tokens=4096)
        keys = set(llm_kwargs("m", config, is_cpu=is_cpu, sleep_supported=False))
        keys |= {"distributed_executor_backend", "tensor_parallel_size", "data_parallel_size", "disable_custom_all_reduce"}
        assert keys <= set(ENGINE_KWARGS_OWNED), keys - set(ENGINE_KWARGS_OWNED)


@pytest.mark.parametrize("lora, full_sync_next, sleep_supported, level", [
    (False, True, True, 2),  # every weight is rewritten next: drop them, no copy to host and back
    (False, False, True, 1),  # weights used again as they are: keep a host copy
    (True, True, True, 1),  # LoRA syncs only adapters: the base weights must survive
    (True, False, True, 1),
    (False, True, False, 0),  # CPU backend: no sleep mode
    (True, False, False, 0),
])
def test_the_sleep_level_drops_the_weights_only_before_a_full_sync(lora, full_sync_next, sleep_supported, level):
    assert sleep_level(lora=lora, full_sync_next=full_sync_next, sleep_supported=sleep_supported) == level


def test_the_engine_starts_with_dummy_weights_only_when_the_actor_syncs_every_weight_first():
    cfg = validate(load_config("grpo_tiny", []))
    assert rollout_load_format(cfg.rollout, cfg.actor) == "dummy"
    assert rollout_load_format(cfg.rollout, dataclasses.replace(cfg.actor, lora_rank=8)) == "auto"  # base not synced
    assert rollout_load_format(cfg.rollout, None) == "auto"  # no trainer: nothing is ever synced
    real = validate(load_config("grpo_tiny", ["rollout.load_format=real"]))
    assert rollout_load_format(real.rollout, real.actor) == "auto"
    config = rollout_config(cfg.rollout, max_model_len=64, seed=0, compute_dtype=torch.float32, on_gpu=True,
                            actor=cfg.actor)
    assert llm_kwargs("m", config, is_cpu=False, sleep_supported=True)["load_format"] == "dummy"


@pytest.mark.gpu
def test_vllm_on_this_gpu_is_the_pinned_release_and_builds_with_cuda_graphs(tmp_path):
    import vllm

    from rlframe.data.tiny_model import build_random_model
    from rlframe.workers.rollout.config import RolloutConfig
    from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine

    check_vllm_version(vllm.__version__)
    path = build_random_model(tmp_path / "model")
    engine = VLLMRolloutEngine(str(path), config=RolloutConfig(backend="vllm", enforce_eager=False,
                                                               enable_prefix_caching=True, kv_cache_bytes=None))
    assert engine.llm is not None
