"""What a worker process holds: its peak resident memory and the bytes of a trained model's state.

    peak_rss_mb()                       # this process's high-water resident set (ru_maxrss), MB
    state_mb(engine.model, optimizer)   # parameters + gradient buffers + optimizer state on this rank, MB

The first is what the machine saw (the runtime, vLLM's cache and every role the process hosts); the
second counts the live tensors of one model (a DTensor by its local shard, a storage once), which is
what a larger model's memory grows with: the part the papers' memory claims are about.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
    """The process's peak resident memory in MB (ru_maxrss: KB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizer_tensors(optimizer):
    """The state tensors of a torch optimizer, or of the torch optimizer a wrapper holds (megatron's)."""
    inner = optimizer
    while inner is not None and not hasattr(inner, "state") and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    state = getattr(inner, "state", None) or {}
    for per_param in state.values():
        for value in (per_param.values() if isinstance(per_param, dict) else ()):
            if hasattr(value, "untyped_storage") and value.dim() > 0:
                yield value


def state_mb(model, optimizer=None) -> dict[str, float]:
    """MB of parameters, gradients and optimizer state on this rank; `model` a module or a list of them
    (megatron's model chunks). Tensors sharing a storage count once."""
    import torch

    modules = model if isinstance(model, (list, tuple)) else [model]
    seen: set[int] = set()

    def size(tensors) -> float:
        total = 0
        for t in tensors:
            local = _local(t)
            ptr = local.untyped_storage().data_ptr()
            if ptr in seen or local.numel() == 0:
                continue
            seen.add(ptr)
            total += local.untyped_storage().nbytes()
        return total / 2**20

    params = [p for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters()]
    # gradients live from a backward to the optimizer step (freed after it): counted as the trainable
    # parameters' own size, the buffers the next backward allocates; none without an optimizer (frozen)
    trainable = sum(_local(p).nbytes for p in params if p.requires_grad) / 2**20 if optimizer is not None else 0.0
    out = {"params_mb": size(params), "grads_mb": trainable}
    out["optimizer_mb"] = size(_optimizer_tensors(optimizer)) if optimizer is not None else 0.0
    out["state_mb"] = out["params_mb"] + out["grads_mb"] + out["optimizer_mb"]
    return out
