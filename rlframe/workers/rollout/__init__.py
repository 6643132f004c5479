"""Rollout (generation) engines behind one interface (`base.RolloutEngine`), chosen by `rollout.backend`.

    from rlframe.workers.rollout import RolloutConfig, SamplingConfig, build_rollout_engine
    engine = build_rollout_engine(model_path, config=RolloutConfig(backend="auto"))
    batch = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_new_tokens=64))
    with engine.weight_update() as consume:      # fed by the resharding executor, bucket by bucket
        execute_plan(plan, local=shards, consumer=consume)
    with engine.lora_update(adapter_config) as consume:  # LoRA (lora_rank > 0): only the adapter
        execute_plan(plan, local=adapter_shards, consumer=consume)

A backend is registered by its spec (rlframe.plugins.BackendSpec: its class and traits); the built-in
specs are vllm_spec.py (vLLM in-process) and hf_spec.py (transformers generate). Files: config.py
(settings), base.py (interface), batch.py (contract batch in/out), vllm_engine.py, hf_engine.py
(backends), vllm_adapt.py (vLLM inside a training worker: process group, replicas, CPU settings),
weight_sync.py (which slice a rank needs, assembling it), kernel_format.py (in-place weight sync),
lora.py (adapter settings, shapes, per-rank boxes; the merged-weights fallback), logprob_check.py
(rollout vs training log-probs). Importing this package imports no torch: the names load on first use.
"""

from __future__ import annotations

import warnings

from rlframe.plugins.backends import backend_spec
from rlframe.plugins.registry import load_target
from rlframe.workers.rollout.config import RolloutConfig, SamplingConfig

__all__ = ["RolloutConfig", "RolloutEngine", "SamplingConfig", "build_rollout_engine", "logprob_diff_metrics",
           "response_log_probs"]


def build_rollout_engine(model_path: str, *, config: RolloutConfig, **kwargs):
    """The engine `config.backend` names; "auto" takes the installed backend its spec ranks first
    (vLLM, else transformers with a warning)."""
    spec = backend_spec(config.backend)
    if not spec.installed():
        raise ValueError(f"rollout.backend={spec.name} needs the {spec.requires!r} package, which is not installed: "
                         f"{spec.install_hint}; or set rollout.backend to an installed one")
    if config.backend == "auto" and spec.auto_priority:  # not auto's first choice: its package is missing
        warnings.warn(f"rollout.backend=auto falls back to {spec.name} ({spec.summary}): the preferred backends are "
                      "not installed", stacklevel=2)
    engine = load_target(spec.target)(model_path, config=config, **kwargs)
    engine.spec = spec  # what the workers ask of it (its weight plan)
    return engine


def __getattr__(name: str):
    if name == "RolloutEngine":
        from rlframe.workers.rollout.base import RolloutEngine

        return RolloutEngine
    if name in ("logprob_diff_metrics", "response_log_probs"):
        from rlframe.workers.rollout import logprob_check

        return getattr(logprob_check, name)
    raise AttributeError(f"module 'rlframe.workers.rollout' has no attribute {name!r}")
