"""Classes registered by name, so a new pass, runtime or model family is one file that registers itself."""

from __future__ import annotations

import importlib
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

    def names(self) -> list[str]:
        self.load()
        return sorted(self.classes)

    def get(self, name: str) -> T:
        self.load()
        if name not in self.classes:
            raise UserError(f"unknown {self.kind} {name!r}", fix=f"use one of: {', '.join(sorted(self.classes))}")
        return self.classes[name]()
