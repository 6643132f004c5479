"""How a group call's DataProto arguments reach the ranks (driver side).

Plain calls (`put_shared`): a DataProto that goes to several ranks as the same object (a DP_COMPUTE
chunk shared by tp/pp peers, a ONE_TO_ALL batch) is serialized once, into the object store, and
sent as a reference (the host fetches it); Ray would otherwise serialize it once per rank.

Compiled calls (`inline_or_put`): every rank reads the whole input channel, so DataProtos travel
inline only while all of them together are small (INLINE_BYTES); otherwise each distinct one is
put into the object store once and only its ranks fetch it.
"""

from __future__ import annotations

# DataProtos of one compiled call travel inside the input channel up to this many bytes in all.
INLINE_BYTES = 256 * 1024


def nbytes(value) -> int:
    """Bytes of a DataProto's tensors and numeric arrays (object arrays counted at 64 B an item)."""
    n = 0
    if value.batch is not None:
        n += sum(t.numel() * t.element_size() for t in value.batch.values())
    for arr in value.non_tensor_batch.values():
        n += arr.size * 64 if arr.dtype == object else arr.nbytes
    return n


def payload_bytes(value) -> int:
    """About how many bytes `value` (a call's arguments or a rank's output) carries: DataProtos as
    `nbytes`, tensors, arrays, bytes and strings by size, numbers 8, containers their items; other
    objects (configs, object-store references) 0. For the run's trace (rlframe/utils/trace.py)."""
    from rlframe.protocol import DataProto

    if isinstance(value, DataProto):
        return nbytes(value)
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, (int, float)):
        return 8
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    numel, element_size = getattr(value, "numel", None), getattr(value, "element_size", None)  # torch tensors
    if callable(numel) and callable(element_size):
        return numel() * element_size()
    return int(getattr(value, "nbytes", 0) or 0)  # numpy arrays


def _dataprotos(per_rank: list) -> dict[int, list]:
    """id -> [DataProto, number of ranks it goes to]."""
    from rlframe.protocol import DataProto

    seen: dict[int, list] = {}
    for call in per_rank:
        if call is not None:
            for v in (*call[0], *call[1].values()):
                if isinstance(v, DataProto):
                    seen.setdefault(id(v), [v, 0])[1] += 1
    return seen


def _put(per_rank: list, chosen: dict[int, object]) -> list:
    """`per_rank` with each chosen DataProto (by id) put into the object store once and replaced by its reference."""
    if not chosen:
        return per_rank
    import ray

    refs = {k: ray.put(v) for k, v in chosen.items()}

    def swap(v):
        return refs.get(id(v), v)

    return [None if call is None else (tuple(swap(a) for a in call[0]), {k: swap(v) for k, v in call[1].items()})
            for call in per_rank]


def put_shared(per_rank: list) -> list:
    """Plain calls: put the DataProtos that go to more than one rank."""
    return _put(per_rank, {k: v for k, (v, n) in _dataprotos(per_rank).items() if n > 1})


def inline_or_put(per_rank: list, *, limit: int = INLINE_BYTES) -> list:
    """Compiled calls: all inline when small together, else put every distinct DataProto."""
    seen = _dataprotos(per_rank)
    if sum(nbytes(v) for v, _ in seen.values()) <= limit:
        return per_rank
    return _put(per_rank, {k: v for k, (v, _) in seen.items()})
