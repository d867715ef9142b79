"""The built-in scenarios: every module of this folder is imported (a scenario is one new file here)."""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
