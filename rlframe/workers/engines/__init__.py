"""Training engines behind one interface (`base.TrainEngine`), chosen by name in config.

    engine_cls = get_train_engine("fsdp")        # FSDP2 + DTensor TP, CPU (gloo) or GPU (nccl)
    engine_cls = get_train_engine("megatron")    # megatron-core TP/PP/DP + distributed optimizer (GPU)
    engine = engine_cls(TrainEngineConfig(model_path=..., dp=2, tp=2))

Backends register lazily ("module:Class") so importing this package does not import a backend's
heavy dependencies (megatron-core, for one, is GPU-only).
"""

from __future__ import annotations

import importlib

from rlframe.workers.engines.base import TrainEngine, TrainEngineConfig

_TRAIN_ENGINES: dict[str, str] = {
    "fsdp": "rlframe.workers.engines.fsdp.engine:FSDPTrainEngine",
    "megatron": "rlframe.workers.engines.megatron.engine:MegatronTrainEngine",
}


def register_train_engine(name: str, target: str) -> None:
    """Register a backend as "package.module:ClassName" under `name` (e.g. "megatron")."""
    if ":" not in target:
        raise ValueError(f"engine target {target!r} must look like 'package.module:ClassName'")
    _TRAIN_ENGINES[name] = target


def available_train_engines() -> list[str]:
    return sorted(_TRAIN_ENGINES)


def get_train_engine(name: str) -> type[TrainEngine]:
    """The engine class registered under `name`."""
    if name not in _TRAIN_ENGINES:
        raise ValueError(f"unknown training engine {name!r}; available: {available_train_engines()}")
    module, cls = _TRAIN_ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["TrainEngine", "TrainEngineConfig", "get_train_engine", "register_train_engine", "available_train_engines"]
