"""`@register`: expose a worker method to the driver with a dispatch mode.

    class ActorWorker(Worker):
        @register(dispatch=Dispatch.DP_COMPUTE)
        def compute_log_prob(self, data: DataProto) -> DataProto: ...

The worker group turns each registered method into a driver-side method of the same name that
splits the inputs, calls all ranks and gathers (see `rlframe.single_controller.dispatch`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from rlframe.single_controller.dispatch import Dispatch, get_dispatch_mode

# Keyword names the driver-side method takes for itself.
RESERVED_KWARGS = ("blocking", "timeout")
_ATTR = "__rlframe_register__"


@dataclass(frozen=True)
class Registration:
    dispatch: str
    blocking: bool
    mesh: str


def register(*, dispatch: "Dispatch | str" = Dispatch.ONE_TO_ALL, blocking: bool = True, mesh: str = "default"):
    """Mark a worker method as callable from the driver.

    dispatch: a mode of the dispatch table (unknown names fail here, at class definition).
    blocking: the driver-side call's default; False returns a future with `.get(timeout=...)`.
    mesh: which of the worker's meshes mesh-driven modes (DP_COMPUTE) follow, e.g. "rollout" for
        generation when it uses another layout than training.
    """
    mode = dispatch.value if isinstance(dispatch, Dispatch) else dispatch
    get_dispatch_mode(mode)  # fail early on unknown modes

    def wrap(fn):
        params = inspect.signature(fn).parameters
        clash = [p for p in RESERVED_KWARGS if p in params]
        if clash:
            raise ValueError(
                f"registered method {fn.__qualname__} has parameters {clash}, which the driver-side "
                f"call reserves for itself ({RESERVED_KWARGS}); rename them"
            )
        setattr(fn, _ATTR, Registration(mode, blocking, mesh))
        return fn

    return wrap


def registered_methods(cls) -> dict[str, Registration]:
    """Every registered method of a worker class (including inherited ones), by name."""
    out = {}
    for name in dir(cls):
        reg = getattr(getattr(cls, name, None), _ATTR, None)
        if isinstance(reg, Registration):
            out[name] = reg
    return out
