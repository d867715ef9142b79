"""Option parsing and loading shared by the CLI commands."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import typer

from servopt.errors import UserError

_FLAG_TYPES = (str, int, float, Path, bool)


def _flag_type(annotation: Any) -> Any:
    """The command-line type of a ``DataOptions`` field: its own where the CLI can parse it, else text the family's
    model parses (e.g. ``--mean 0.485,0.456,0.406`` for a tuple)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] if typing.get_origin(annotation) in (
        typing.Union, types.UnionType) else [annotation]
    inner = args[0] if len(args) == 1 else str
    if inner is bool:
        return bool
    return (inner if inner in _FLAG_TYPES else str) | None


def data_flags() -> dict[str, inspect.Parameter]:
    """One keyword parameter per field of every registered family's ``DataOptions`` (the help is the field's
    description): a family's data options are declared once, in its file, and every command that reads data offers
    them. Read when the CLI is built, so a family registered before that (a plugin) brings its flags."""
    from servopt.families import FAMILIES

    FAMILIES.load()
    params: dict[str, inspect.Parameter] = {}
    for cls in FAMILIES.classes.values():
        for name, field in cls.DataOptions.model_fields.items():
            if name in params:
                continue
            kind = _flag_type(field.annotation)
            option = typer.Option("--" + name.replace("_", "-"), help=field.description or name.replace("_", " "),
                                  rich_help_panel="Data")
            params[name] = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[kind, option],
                                             default=False if kind is bool else None)
    return params


class with_data_flags:  # noqa: N801 - used as a decorator, like functools.wraps
    """A command whose ``data`` argument collects the data flags of ``data_flags()``: typer sees the command's own
    parameters plus one per flag (``__signature__``, computed when the CLI is built), and the command gets them as
    one dict of the flags the user gave."""

    def __init__(self, func: typing.Callable[..., Any]) -> None:
        self.func = func
        functools.update_wrapper(self, func, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())

    def _own(self) -> list[inspect.Parameter]:
        hints = typing.get_type_hints(self.func, include_extras=True)
        return [p.replace(annotation=hints.get(p.name, p.annotation)) for p in inspect.signature(self.func).parameters.values()
                if p.name != "data"]

    @property
    def __signature__(self) -> inspect.Signature:  # type: ignore[override]
        own = self._own()
        flags = [p for name, p in data_flags().items() if name not in {q.name for q in own}]
        ordered = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        return inspect.Signature([*ordered, *flags])

    @property
    def __annotations__(self) -> dict[str, Any]:  # type: ignore[override]
        return {p.name: p.annotation for p in self.__signature__.parameters.values()}

    def __call__(self, **kwargs: Any) -> Any:
        names = set(data_flags())
        data = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        return self.func(data=data, **kwargs)


def parse_int_list(text: str | None, what: str) -> list[int]:
    if not text:
        return []
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}", fix=f"e.g. {what} 1,8,32") from e
    if any(v <= 0 for v in values):
        raise UserError(f"{what} values must be positive, got {text!r}", fix=f"e.g. {what} 1,8,32")
    return values


def parse_grid(text: str) -> list[tuple[int, int]]:
    """``1x16,32x128`` → [(1, 16), (32, 128)] (batch × sequence length)."""
    points = []
    for item in text.split(","):
        b, _, n = item.strip().lower().partition("x")
        if not (b.isdigit() and n.isdigit() and int(b) > 0 and int(n) > 0):
            raise UserError(f"--grid point {item!r} is not BATCHxLENGTH", fix="e.g. --grid 1x16,32x128")
        points.append((int(b), int(n)))
    return points


def parse_input_shapes(items: list[str] | None) -> dict[str, list[int]] | None:
    if not items:
        return None
    shapes = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            shapes[name] = [int(d) for d in dims.lower().split("x")]
        except ValueError as e:
            raise UserError(f"--input-shape {item!r} is not NAME=DxDxD", fix="e.g. --input-shape input=1x3x224x224") from e
        if not name or not shapes[name]:
            raise UserError(f"--input-shape {item!r} is not NAME=DxDxD", fix="e.g. --input-shape input=1x3x224x224")
    return shapes


def parse_options(items: list[str] | None) -> dict[str, Any]:
    """``-o KEY=VALUE`` runtime options; values are read as JSON where they parse (numbers, true/false), else text."""
    import json

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--option {item!r} is not KEY=VALUE", fix="e.g. -o graph_optimization_level=basic")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def open_model(path: Path, arch: str | None, num_classes: int | None, trust_pickle: bool, input_shape: list[str] | None,
               output: str | None = None):
    from servopt.models.sources import load_model

    return load_model(path, arch=arch, num_classes=num_classes, trust_pickle=trust_pickle, input_shape=parse_input_shapes(input_shape),
                      output=output)


def data_options(model, **raw: Any):
    """The user's data flags as the model family's ``DataOptions`` (a flag for another family is refused)."""
    from servopt.families import family_of

    family = family_of(model.spec)
    return family, family.data_options(raw)


def open_data(model, **raw: Any):
    """The evaluation data for ``model`` (its family reads it), with the spec updated from what the data taught, and
    what to tell the user when no data was given (empty when it was)."""
    family, options = data_options(model, **raw)
    dataset, spec = family.read_whole(model.spec, options)  # nothing tunes here: every sample is judged
    model.spec = spec
    return dataset, "" if family.has_data(options) else family.no_data_note
