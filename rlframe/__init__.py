"""rlframe: a single-controller RLHF framework (Ray driver, SPMD worker groups, vLLM rollout)."""

__version__ = "0.1.0"
