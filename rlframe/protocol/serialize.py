"""How a DataProto's tensors cross a process boundary without per-element pickling.

Default tensor pickling writes each storage into the pickle stream (in-band): the bytes are copied
into the stream and out again. Here every tensor is sent as one contiguous `numpy.uint8` array.
numpy implements pickle protocol 5 (PEP 574), so under `pickle.dumps(..., protocol=5,
buffer_callback=...)`, and under Ray (which serializes with protocol 5 and hands such buffers to
its shared-memory object store), the payload travels out-of-band: no per-element work, at most a
memcpy of each tensor's bytes.

Viewing the bytes as uint8 (rather than mapping torch dtypes to numpy dtypes) makes every dtype
round-trip exactly, including those numpy lacks: bfloat16, the float8 types, bool.

Receiving side: a buffer that arrives writable (plain in-process `pickle.loads`) is wrapped with
`torch.from_numpy` without a copy. A buffer that arrives read-only (Ray's object store) is copied
once: torch tensors cannot be read-only, and the object store shares that memory with every reader
of the same object on the node (e.g. the tp/pp peers that receive the same DP_COMPUTE chunk), so an
in-place op on an aliasing tensor would silently change another worker's input. Tensors always
arrive on the CPU; the receiver moves them with `DataProto.to(device)`.

That copy is wasted when the receiver copies anyway, e.g. a driver that gathers worker outputs
and immediately `DataProto.concat`s them. Inside `with receive_zero_copy():` read-only buffers are
aliased instead; the caller promises not to write to those tensors and to drop them (concat, `.to`
another device, or `.clone()`) before anything else could.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Iterator

import numpy as np
import torch

# Bumped when the state layout changes, so an old pickle fails with a clear message.
STATE_VERSION = 1


_local = threading.local()


@contextlib.contextmanager
def receive_zero_copy() -> Iterator[None]:
    """Alias (do not copy) read-only buffers while unpickling DataProtos in this thread.

    Example (a gather that copies anyway):
        >>> with receive_zero_copy():
        ...     merged = DataProto.concat(ray.get(refs))
    """
    previous = getattr(_local, "alias", False)
    _local.alias = True
    try:
        yield
    finally:
        _local.alias = previous


def tensor_to_wire(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype, tuple[int, ...]]:
    """(bytes as a 1-D uint8 numpy array, dtype, shape) of a tensor; copies only when it must.

    A contiguous CPU tensor is viewed, not copied; a strided or non-CPU tensor is made contiguous
    on the CPU first (one copy, unavoidable).
    """
    shape = tuple(t.shape)
    dtype = t.dtype
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8), dtype, shape
    # view(uint8) reinterprets the bytes; it needs an element size of 1 (bool) or a last dim
    # it can expand, which a 1-D contiguous tensor always has.
    return flat.view(torch.uint8).numpy(), dtype, shape


def tensor_from_wire(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `tensor_to_wire`: zero-copy for writable buffers, one copy for read-only ones."""
    if data.size == 0:
        return torch.empty(shape, dtype=dtype)
    if data.flags.writeable:
        return torch.from_numpy(data).view(dtype).reshape(shape)
    if not getattr(_local, "alias", False):
        # See the module docstring: never alias shared object-store memory by default.
        return torch.from_numpy(data.copy()).view(dtype).reshape(shape)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data).view(dtype).reshape(shape)


def batch_to_state(batch) -> dict[str, Any] | None:
    """A TensorDict with batch_size [B] as a plain dict that pickles its payload out-of-band."""
    if batch is None:
        return None
    tensors = {}
    for key, value in batch.items():
        tensors[key] = tensor_to_wire(value)
    return {"batch_size": int(batch.batch_size[0]), "tensors": tensors}


def batch_from_state(state: dict[str, Any] | None):
    """Inverse of `batch_to_state`: a TensorDict on the CPU."""
    from tensordict import TensorDict

    if state is None:
        return None
    tensors = {key: tensor_from_wire(*wire) for key, wire in state["tensors"].items()}
    return TensorDict(tensors, batch_size=[state["batch_size"]])
