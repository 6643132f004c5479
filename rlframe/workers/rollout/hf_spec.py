"""The transformers rollout backend's spec (rlframe.plugins): `generate` on one process's whole model,
the fallback where vLLM is not installed. Imports nothing heavy."""

from rlframe.plugins.backends import BackendSpec, register_rollout_backend
from rlframe.workers.rollout.vllm_spec import weight_plan

HF = register_rollout_backend(BackendSpec(
    name="hf", target="rlframe.workers.rollout.hf_engine:HFRolloutEngine",
    summary="transformers generate, one whole model per process (slower; where vLLM is not installed)",
    auto_priority=1, weight_plan=weight_plan))
