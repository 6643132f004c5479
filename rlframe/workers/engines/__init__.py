"""Training engines behind one interface (`base.TrainEngine`), chosen by `<role>.strategy`.

    engine_cls = get_train_engine("fsdp")        # FSDP2 + DTensor TP, CPU (gloo) or GPU (nccl)
    engine_cls = get_train_engine("megatron")    # megatron-core TP/PP/DP + distributed optimizer
    engine = engine_cls(TrainEngineConfig(model_path=..., dp=2, tp=2))

An engine is registered by its spec (rlframe.plugins.EngineSpec: its class as "module:Class" and its
traits); the built-in specs are fsdp/spec.py and megatron/spec.py. Importing this package imports no
backend (megatron-core, for one) and no torch: the names below load on first use.
"""

from __future__ import annotations

from rlframe.plugins.engines import TRAIN_ENGINES, engine_spec, register_train_engine
from rlframe.plugins.registry import load_target


def available_train_engines() -> list[str]:
    return list(TRAIN_ENGINES.names())


def get_train_engine(name: str):
    """The engine class registered under `name`."""
    return load_target(engine_spec(name).target)


def __getattr__(name: str):
    if name in ("TrainEngine", "TrainEngineConfig"):
        from rlframe.workers.engines import base

        return getattr(base, name)
    raise AttributeError(f"module 'rlframe.workers.engines' has no attribute {name!r}")


__all__ = ["TrainEngine", "TrainEngineConfig", "get_train_engine", "register_train_engine", "available_train_engines"]
