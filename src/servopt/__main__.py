"""``python -m servopt`` (the same as the ``servopt`` command)."""

from servopt.cli import app

app(prog_name="servopt")
