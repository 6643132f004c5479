"""From composed YAML (a nested dict) to the typed `RunConfig`, with errors that name the key.

Hydra only composes files and command-line overrides; this module is the one place where keys
and types are checked, so a typo (`actor.lrr=1e-4`) fails with the closest valid names.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from rlframe.config.schema import RunConfig


def _allowed_types(tp) -> tuple:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(tp) for t in _allowed_types(arg))
    if origin is not None:
        return (origin,)
    return (tp,)


def _coerce(value: Any, tp, where: str):
    allowed = _allowed_types(tp)
    if value is None:
        if type(None) in allowed:
            return None
        raise ValueError(f"config key {where} must not be null (expected {tp})")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, tuple(a for a in allowed if isinstance(a, type))):
        if isinstance(value, bool) and bool not in allowed:
            raise ValueError(f"config key {where}={value!r}: expected {tp}, got a boolean")
        return list(value) if list in allowed else value
    raise ValueError(f"config key {where}={value!r}: expected {tp}, got {type(value).__name__}")


def from_dict(cls, data: Any, where: str = ""):
    """Build dataclass `cls` from `data`, recursively; unknown keys fail with suggestions."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ValueError(f"config section {where or '<root>'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(sorted(fields))}"
            raise ValueError(f"unknown config key {path}{hint}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def build_config(raw: dict) -> RunConfig:
    """Typed config from the composed dict (a missing section takes its defaults)."""
    raw = dict(raw or {})
    raw.pop("defaults", None)
    raw.pop("hydra", None)
    return from_dict(RunConfig, raw)


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)
