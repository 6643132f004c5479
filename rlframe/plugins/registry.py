"""One registry mechanism for plugin specs: name -> spec, the built-ins loaded on first use.

The built-in specs live next to their plugins, in modules that import nothing heavy (no torch), so
that asking a spec costs nothing: a registry knows those modules by name and imports them before
its first answer. A spec names its implementation as "package.module:attribute" (`load_target`),
imported only where it runs.
"""

from __future__ import annotations

import importlib
from typing import Any, Generic, TypeVar

S = TypeVar("S")


def load_target(target: str) -> Any:
    """The object named by "package.module:attribute" (ValueError saying what is wrong otherwise)."""
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"{target!r} must look like 'package.module:attribute'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load {target!r} ({type(err).__name__}: {err}); check the module is on "
                         "PYTHONPATH and defines it") from err


class SpecRegistry(Generic[S]):
    """Specs of one kind of plugin by name.

    Args:
        kind: what the plugins are, for messages ("training engine").
        key: the config key that names one, for messages ("actor.strategy").
        builtin_modules: modules that register the built-in specs (imported before any lookup).
        how_to_add: the call that registers one, for messages.
    """

    def __init__(self, kind: str, *, key: str, builtin_modules: tuple[str, ...], how_to_add: str):
        self.kind, self.key, self.how_to_add = kind, key, how_to_add
        self._builtin_modules = builtin_modules
        self._specs: dict[str, S] = {}
        self._loaded = False

    def _load_builtins(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # first: the modules call register() while importing
        try:
            for module in self._builtin_modules:
                importlib.import_module(module)
        except BaseException:
            self._loaded = False
            raise

    def register(self, spec: S) -> S:
        """Add `spec` under `spec.name`; a name registered to another spec is an error."""
        self._load_builtins()
        name = getattr(spec, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} spec needs a non-empty name, got {name!r}")
        held = self._specs.get(name)
        if held is not None and held != spec:
            raise ValueError(f"{self.kind} {name!r} is already registered ({held}); pick another name")
        self._specs[name] = spec
        return spec

    def get(self, name: str) -> S:
        self._load_builtins()
        try:
            return self._specs[name]
        except KeyError:
            raise ValueError(f"{self.key}={name!r} is not a registered {self.kind}; known: {', '.join(self.names())}. "
                             f"Check the spelling, or register one with {self.how_to_add} in a module listed "
                             "under imports:") from None

    def names(self) -> tuple[str, ...]:
        self._load_builtins()
        return tuple(sorted(self._specs))

    def specs(self) -> list[S]:
        self._load_builtins()
        return [self._specs[n] for n in sorted(self._specs)]

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return name in self._specs
