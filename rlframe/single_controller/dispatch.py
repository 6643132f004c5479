"""Dispatch modes: how a driver-side call is split over ranks and how their outputs are gathered.

Every registered worker method names one mode. A mode is one entry in `DISPATCH_TABLE`: a `split`
that turns the driver's (args, kwargs) into one (args, kwargs) per rank (or None: that rank is not
called) and a `collect` that turns the per-rank outputs into the driver's result. Adding a mode is
adding an entry (`register_dispatch_mode`).

| mode        | split                                                        | collect                          |
|-------------|--------------------------------------------------------------|----------------------------------|
| ONE_TO_ALL  | the same args to every rank                                  | list of all outputs, rank order  |
| ALL_TO_ALL  | every arg is a list of world-size items; rank i gets item i  | list of all outputs, rank order  |
| RANK_ZERO   | args to rank 0 only                                          | rank 0's output                  |
| DP_COMPUTE  | DataProto args chunked over the mesh's dp dim; tp/pp/cp/sp   | outputs of one rank per dp group |
|             | peers of a dp rank get the same chunk; other args to all     | (tp=0, last pp stage), dp order; |
|             |                                                              | DataProtos concatenated, their   |
|             |                                                              | meta_info['metrics'] gathered    |
|             |                                                              | into a list (one per dp rank)    |
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable


# meta_info key under which a worker returns its per-rank measurements ({name: float}).
METRICS_KEY = "metrics"


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE = "dp_compute"


@dataclass(frozen=True)
class RankInfo:
    """What dispatch needs to know about one rank of a role (from the worker's mesh)."""

    rank: int
    dp_rank: int
    dp_size: int
    collect: bool  # this rank's output is part of the gathered result


Call = tuple[tuple, dict]
SplitFn = Callable[[tuple, dict, list[RankInfo]], list["Call | None"]]
CollectFn = Callable[[list[tuple[RankInfo, Any]]], Any]


@dataclass(frozen=True)
class DispatchMode:
    split: SplitFn
    collect: CollectFn
    doc: str
    # `collect` copies every DataProto it returns (e.g. concatenates), so outputs may arrive
    # without a private copy of their tensors (rlframe.protocol.receive_zero_copy).
    copies_outputs: bool = False
    # `collect` reads only ranks whose RankInfo.collect is set; the others send back None.
    collect_ranks_only: bool = False


def _same_to_all(args, kwargs, ranks):
    return [(args, kwargs) for _ in ranks]


def _all_outputs(outputs):
    return [out for _, out in outputs]


def _per_rank(args, kwargs, ranks):
    n = len(ranks)
    for where, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"{type(value).__name__} of length {len(value)}" if hasattr(value, "__len__") else type(value).__name__
            raise ValueError(
                f"ALL_TO_ALL needs every argument to be a list with one item per rank ({n}); "
                f"{where} is a {got}"
            )
    return [
        (tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}) for i in range(n)
    ]


def _rank_zero_only(args, kwargs, ranks):
    return [(args, kwargs) if r.rank == 0 else None for r in ranks]


def _rank_zero_output(outputs):
    return next(out for info, out in outputs if info.rank == 0)


def _chunk_over_dp(args, kwargs, ranks):
    from rlframe.protocol import DataProto

    dp_size = ranks[0].dp_size

    def chunks(value, where):
        if not isinstance(value, DataProto):
            return None
        if len(value) % dp_size:
            raise ValueError(
                f"DP_COMPUTE cannot split {where} of batch size {len(value)} over dp={dp_size}: "
                f"{len(value)} % {dp_size} = {len(value) % dp_size}; make the batch size a multiple "
                "of the data-parallel size or call DataProto.pad_to_divisor first"
            )
        return value.chunk(dp_size)

    arg_chunks = [chunks(a, f"argument {i}") for i, a in enumerate(args)]
    kw_chunks = {k: chunks(v, f"argument {k!r}") for k, v in kwargs.items()}
    calls = []
    for r in ranks:
        a = tuple(c[r.dp_rank] if c is not None else v for c, v in zip(arg_chunks, args))
        kw = {k: (kw_chunks[k][r.dp_rank] if kw_chunks[k] is not None else v) for k, v in kwargs.items()}
        calls.append((a, kw))
    return calls


def _gather_dp(outputs):
    from rlframe.protocol import DataProto

    picked = sorted(((info.dp_rank, out) for info, out in outputs if info.collect), key=lambda x: x[0])
    assert [d for d, _ in picked] == list(range(len(picked))), [d for d, _ in picked]
    values = [out for _, out in picked]
    if values and all(isinstance(v, DataProto) for v in values):
        # Per-rank measurements differ by rank: gathered as a list (one dict per dp rank).
        return DataProto.concat(values, gather_meta_keys=(METRICS_KEY,))
    if all(v is None for v in values):
        return None
    # Mixed outputs are returned as they are: DataProtos among them get their private copy here.
    return [DataProto.concat([v]) if isinstance(v, DataProto) else v for v in values]


DISPATCH_TABLE: dict[str, DispatchMode] = {
    Dispatch.ONE_TO_ALL.value: DispatchMode(_same_to_all, _all_outputs, "same args to all ranks"),
    Dispatch.ALL_TO_ALL.value: DispatchMode(_per_rank, _all_outputs, "rank i gets item i of each arg"),
    Dispatch.RANK_ZERO.value: DispatchMode(_rank_zero_only, _rank_zero_output, "rank 0 only"),
    Dispatch.DP_COMPUTE.value: DispatchMode(_chunk_over_dp, _gather_dp, "DataProto split over dp",
                                                copies_outputs=True, collect_ranks_only=True),
}


def register_dispatch_mode(name: str, *, split: SplitFn, collect: CollectFn, doc: str = "") -> None:
    """Add a dispatch mode usable as `@register(dispatch=name)`."""
    if name in DISPATCH_TABLE:
        raise ValueError(f"dispatch mode {name!r} is already registered; pick another name")
    DISPATCH_TABLE[name] = DispatchMode(split, collect, doc)


def get_dispatch_mode(name: "str | Dispatch") -> DispatchMode:
    key = name.value if isinstance(name, Dispatch) else name
    if key not in DISPATCH_TABLE:
        raise ValueError(
            f"unknown dispatch mode {key!r}; known modes: {sorted(DISPATCH_TABLE)} "
            "(add one with rlframe.single_controller.dispatch.register_dispatch_mode)"
        )
    return DISPATCH_TABLE[key]
