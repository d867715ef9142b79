"""User-facing errors: each says what is wrong and how to fix it.

The CLI catches ``UserError`` and prints it without a traceback; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, with the fix spelled out."""

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}" + (f"\n  fix: {fix}" if fix else ""))
