"""Rollout backends' specs: what a generation engine supports and holds, asked before it runs.

Validation, the planner, the memory estimate and the workers read a backend's `BackendSpec`; the
workers build it from `target`. No torch here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable

from rlframe.plugins.registry import SpecRegistry


@dataclass(frozen=True)
class BackendSpec:
    """A rollout backend's traits.

    name: the value of `rollout.backend` that selects it.
    target: "package.module:Class" of its `rlframe.workers.rollout.RolloutEngine` subclass.
    summary: one line saying what it is.
    requires: a module that must be importable for it to run (None: nothing beyond rlframe's own).
    install_hint: how to install `requires`.
    auto_priority: `rollout.backend=auto` takes the installed backend with the lowest value; None:
        auto never picks it.
    tensor_parallel: one engine spans `rollout.tp` processes (its tp ranks hold whole kv heads);
        without it rollout.tp must be 1.
    paged_kv_cache: its memory is weights + an activation peak + a KV cache sized by
        rollout.kv_cache_bytes or gpu_memory_utilization (vLLM's); else the weights and whatever its
        generate allocates (not estimated).
    owned_engine_kwargs: keywords of its engine that rlframe derives from other settings (keyword ->
        the setting to use instead): rollout.engine_kwargs may not set them.
    engine_kwargs: whether it takes rollout.engine_kwargs at all.
    weight_plan(metas, *, src, dst, model_path): the resharding plan from a training layout into the
        slices its tp ranks hold (its weight target layout).
    """

    name: str
    target: str
    summary: str = ""
    requires: str | None = None
    install_hint: str = ""
    auto_priority: int | None = None
    tensor_parallel: bool = False
    paged_kv_cache: bool = False
    owned_engine_kwargs: dict[str, str] = field(default_factory=dict)
    engine_kwargs: bool = False
    weight_plan: Callable | None = None

    def __hash__(self):
        return hash((self.name, self.target))

    def installed(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


ROLLOUT_BACKENDS: SpecRegistry[BackendSpec] = SpecRegistry(
    "rollout backend", key="rollout.backend",
    builtin_modules=("rlframe.workers.rollout.vllm_spec", "rlframe.workers.rollout.hf_spec"),
    how_to_add="rlframe.plugins.register_rollout_backend(BackendSpec(...))")


def register_rollout_backend(spec: BackendSpec) -> BackendSpec:
    """Register a rollout backend's spec (`rollout.backend=<spec.name>` selects it)."""
    if not isinstance(spec, BackendSpec):
        raise ValueError(f"register_rollout_backend takes a BackendSpec, got {type(spec).__name__}")
    if spec.name == "auto":
        raise ValueError("'auto' is rollout.backend's choice of an installed backend; name the backend otherwise")
    return ROLLOUT_BACKENDS.register(spec)


def backend_spec(name: str) -> BackendSpec:
    """The spec `rollout.backend` names; "auto": the installed backend auto prefers."""
    if name != "auto":
        return ROLLOUT_BACKENDS.get(name)
    ranked = sorted((s for s in ROLLOUT_BACKENDS.specs() if s.auto_priority is not None and s.installed()),
                    key=lambda s: s.auto_priority)
    if not ranked:
        raise ValueError("rollout.backend=auto: no rollout backend that auto may pick is installed; name one of "
                         f"{', '.join(ROLLOUT_BACKENDS.names())}")
    return ranked[0]
