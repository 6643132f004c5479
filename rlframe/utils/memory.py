"""What a worker process holds: its peak resident memory and the bytes of a trained model's state.

    peak_rss_mb()                       # this process's high-water resident set (ru_maxrss), MB
    state_mb(engine.model, optimizer)   # parameters + gradient buffers + optimizer state on this rank, MB

The first is what the machine saw (the runtime, vLLM's cache and every role the process hosts); the
second counts the live tensors of one model (a DTensor by its local shard, a storage once), which is
what a larger model's memory grows with: the part the papers' memory claims are about. It is the
state a rank keeps between steps; FSDP's gather_once_per_step (the CPU default) also holds the
gathered parameters and their unsharded gradients during a step, dp times the sharded size.
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


def _optimizer_parts(optimizer):
    """Every torch optimizer and mixed-precision wrapper inside `optimizer` (megatron's chained
    optimizers and their wrappers included)."""
    stack = [optimizer]
    while stack:
        opt = stack.pop()
        if opt is None:
            continue
        yield opt
        stack.extend(getattr(opt, "chained_optimizers", None) or ())
        inner = getattr(opt, "optimizer", None)
        if inner is not None and inner is not opt:
            stack.append(inner)


def _optimizer_tensors(optimizer):
    """The optimizer's state tensors (Adam's moments) and a mixed-precision wrapper's fp32 master
    copies (megatron's distributed optimizer keeps them outside `state`)."""
    import torch

    for part in _optimizer_parts(optimizer):
        if isinstance(part, torch.optim.Optimizer):
            for per_param in part.state.values():
                for value in per_param.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        yield value
        for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(part, name, None) or ():
                yield from (t for t in group if isinstance(t, torch.Tensor))


def _grad_buffers(modules):
    """Persistent gradient buffers (megatron's DDP: one contiguous buffer, fp32 when grads reduce in
    fp32); None when the model keeps none between steps."""
    # megatron's DDP keeps its buffers in a list attribute that shadows nn.Module.buffers (a method)
    lists = [getattr(m, name, None) for m in modules for name in ("buffers", "expert_parallel_buffers")]
    buffers = [b for found in lists if isinstance(found, list) for b in found]
    grads = [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]
    return grads or None


def state_mb(model, optimizer=None) -> dict[str, float]:
    """MB of parameters, gradient buffers and optimizer state on this rank; `model` a module or a list of them
    (megatron's model chunks); `optimizer` None for a model that does not train. Tensors sharing a
    storage count once (parameters that are views of one flat buffer count as that buffer)."""
    import torch

    modules = [m for m in (model if isinstance(model, (list, tuple)) else [model]) if isinstance(m, torch.nn.Module)]
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

    params = [p for m in modules for p in m.parameters()]
    out = {"params_mb": size(params)}
    if optimizer is None:
        out["grads_mb"] = 0.0
    elif (buffers := _grad_buffers(modules)) is not None:
        out["grads_mb"] = size(buffers)
    else:
        # gradients live from a backward to the optimizer step (freed after it): counted as the trainable
        # parameters' own size, the buffers the next backward allocates
        out["grads_mb"] = sum(_local(p).nbytes for p in params if p.requires_grad) / 2**20
    out["optimizer_mb"] = size(_optimizer_tensors(optimizer)) if optimizer is not None else 0.0
    out["state_mb"] = out["params_mb"] + out["grads_mb"] + out["optimizer_mb"]
    return out
