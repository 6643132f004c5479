"""megatron-core on a CPU-only torch: redirect its CUDA-only calls, skip or fake no collective.

megatron-core's modules are plain torch code that runs on any device, but a few places name CUDA
outright. On a machine without CUDA, `apply()` (once per process, at engine construction) and
`redirect()` (around every call into megatron-core) send them to the CPU. Checked against
megatron-core 0.16.1 (`CHECKED_VERSION`); any other version is refused with a clear error, since
the call sites below may have moved.

Process-wide patches, installed by `apply()` (each would otherwise raise on a CPU-only torch):
- `torch.cuda.current_device()` returns the CPU device. megatron-core uses it only as a `device=`
  argument: rotary embeddings (`rotary_pos_embedding.py`), attention masks and buffers
  (`attention.py`, `dot_product_attention.py`, `transformer_layer.py`), tensor-parallel mappings and
  layers (`tensor_parallel/mappings.py`, `layers.py`, `utils.py`), the pipeline's shape exchange
  (`p2p_communication.py`), DDP's param-and-grad buffers (`param_and_grad_buffer.py`) and the
  distributed optimizer's buffers (`distrib_optimizer.py`).
- `torch.cuda.synchronize()` is a no-op: pipeline p2p calls it after batched isend/irecv
  (`p2p_communication.py`, with `batch_p2p_sync` or `variable_seq_lengths`); gloo requests are
  already waited on by then, so there is nothing to wait for.
- The model-parallel RNG tracker (`tensor_parallel/random.py`: `CudaRNGStatesTracker.add`,
  `_get_cuda_rng_state`, `_set_cuda_rng_state`, used by `model_parallel_cuda_manual_seed`, by every
  `fork()` around dropout and by activation recompute) keeps the same named streams on the CPU
  default generator. rlframe builds models without dropout; with dropout every tp rank would have to
  seed the CPU generator identically.

Scoped to calls into megatron-core, by `redirect()` (a `TorchFunctionMode`, so it costs nothing
outside them):
- `device="cuda"` / `device=0` in factory functions and `.to(...)`, and `.cuda()`, map to the CPU:
  the schedules' token counters (`schedules.py`), the optimizer's found-inf / scale tensors
  (`optimizer.py`, `grad_scaler.py`), grad clipping and zero counting (`clip_grads.py`), the
  language module's embedding sync (`language_module.py`) and the state-dict reloads.
- `tensor.type()` called from megatron-core answers the CUDA type name (`torch.cuda.FloatTensor`):
  the optimizers choose their code path by that string and assert on it (`optimizer.py`,
  `distrib_optimizer.py`, `clip_grads.py`).
Every collective (tp all-reduce / all-gather, dp reduce-scatter, the distributed optimizer's
all-gather, pipeline isend/irecv) still runs, on the gloo process group.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

CHECKED_VERSION = "0.16.1"
_CPU = torch.device("cpu")
_applied = False


def needed() -> bool:
    """True on a torch without a usable CUDA device (then megatron-core needs `apply`)."""
    return not torch.cuda.is_available()


def check_version(installed: str | None = None) -> None:
    """Refuse a megatron-core other than the version the redirections were checked against."""
    if installed is None:
        from megatron.core import package_info

        installed = package_info.__version__
    if installed != CHECKED_VERSION:
        raise ValueError(
            f"megatron-core {installed} is installed, but rlframe's CPU support for the megatron "
            f"engine was checked against {CHECKED_VERSION} only (its CUDA-only call sites move between versions). "
            f"Install megatron-core=={CHECKED_VERSION} to train on CPU, or use strategy=fsdp"
        )


def apply() -> None:
    """Install the process-wide CPU redirections (idempotent; does nothing where CUDA is available)."""
    global _applied
    if _applied or not needed():
        return
    check_version()
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda device=None: None
    mrandom._get_cuda_rng_state = _get_rng_state
    mrandom._set_cuda_rng_state = _set_rng_state
    mrandom.CudaRNGStatesTracker.add = _tracker_add
    _applied = True


def _get_rng_state(device=None, clone=False, graph_safe=False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device=-1, graph_safe=False) -> None:
    torch.set_rng_state(new_state)


def _tracker_add(self, name: str, seed: int) -> None:
    """`CudaRNGStatesTracker.add` on the CPU generator: a named state seeded with `seed`."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.seeds_.add(seed)
    outer = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(outer)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CpuRedirect(TorchFunctionMode):
    """See the module docstring: CUDA device arguments -> CPU; CUDA type names for megatron-core."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            caller = sys._getframe(1).f_globals.get("__name__", "")
            return name.replace("torch.", "torch.cuda.", 1) if caller.startswith("megatron.") else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def redirect():
    """Context for calls into megatron-core: the scoped redirections where CUDA is absent."""
    return _CpuRedirect() if _applied else contextlib.nullcontext()
