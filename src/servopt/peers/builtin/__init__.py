"""The built-in peers: every module of this folder is imported (so a peer is one new file here, nothing else to edit)."""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
