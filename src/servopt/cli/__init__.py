"""The ``servopt`` command line (typer + rich). Each command is a thin layer over a module; each command module
registers on ``cli.app.app`` and imports only ``cli.app``, ``cli.common`` and ``cli.display``."""

from servopt.cli import bench, compare, envs, optimize, serve  # noqa: F401  (registers the commands)
from servopt.cli.app import app

__all__ = ["app"]
