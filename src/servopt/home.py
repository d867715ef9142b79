"""Where servopt keeps what it builds once and reuses (the demo model, runtime environments).

One definition, so every cache moves together when ``$SERVOPT_HOME`` is set.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_home() -> Path:
    """``$SERVOPT_HOME``, else ``~/.cache/servopt``; read at each call so tests and callers can redirect it."""
    return Path(os.environ.get("SERVOPT_HOME", Path.home() / ".cache" / "servopt"))
