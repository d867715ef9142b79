"""Classes registered by name, so a new pass, runtime or model family is one file that registers itself."""

from __future__ import annotations

import functools
import importlib
import os
from importlib import metadata
from typing import Generic, TypeVar

from servopt.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """``@REGISTRY.register`` on a class with a ``name``; ``REGISTRY.get(name)`` returns an instance.

    The built-ins live in ``builtins`` (a package whose import registers them), imported on first lookup so
    nothing heavy is loaded before a name is asked for."""

    def __init__(self, kind: str, builtins: str) -> None:
        self.kind, self.builtins = kind, builtins
        self.classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        self.classes[cls.name] = cls  # type: ignore[attr-defined]
        return cls

    def load(self) -> None:
        importlib.import_module(self.builtins)
        load_plugins()

    def names(self) -> list[str]:
        self.load()
        return sorted(self.classes)

    def get(self, name: str) -> T:
        self.load()
        if name not in self.classes:
            raise UserError(f"unknown {self.kind} {name!r}", fix=f"use one of: {', '.join(sorted(self.classes))}")
        return self.classes[name]()


_plugins_loaded: set[str] = set()


def load_plugins() -> None:
    """Import the plugins that register families, runtimes or passes from outside servopt: the modules named by the
    ``servopt.plugins`` entry points of installed packages, and those listed in ``SERVOPT_PLUGINS`` (comma-separated
    module names). Every process does it, so a job process knows the plugin its parent used. Every registry lookup
    calls it, the server's per request among them, so the installed packages are scanned once per process (a scan
    reads every package's metadata: 7 ms of the 13 ms a one-sentence embedding request cost before it was cached)."""
    names = list(_entry_point_plugins())
    names += [n.strip() for n in os.environ.get("SERVOPT_PLUGINS", "").split(",") if n.strip()]
    for name in names:
        if name not in _plugins_loaded:
            _plugins_loaded.add(name)
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise UserError(f"plugin {name!r} could not be imported: {e}",
                                fix="install it, or correct SERVOPT_PLUGINS / the package's servopt.plugins entry point") from e


@functools.cache
def _entry_point_plugins() -> tuple[str, ...]:
    """The modules named by installed packages' ``servopt.plugins`` entry points (fixed for a process's life)."""
    return tuple(ep.module for ep in metadata.entry_points(group="servopt.plugins"))
