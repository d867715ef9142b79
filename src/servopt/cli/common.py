"""Option parsing and loading shared by the CLI commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servopt.errors import UserError


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


def parse_floats3(text: str | None, what: str) -> tuple[float, float, float] | None:
    if not text:
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError as e:
        raise UserError(f"{what} must be three numbers, got {text!r}", fix=f"e.g. {what} 0.485,0.456,0.406") from e
    if len(values) != 3:
        raise UserError(f"{what} must be three numbers, got {text!r}", fix=f"e.g. {what} 0.485,0.456,0.406")
    return values  # type: ignore[return-value]


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


def open_model(path: Path, arch: str | None, num_classes: int | None, trust_pickle: bool, input_shape: list[str] | None):
    from servopt.models.sources import load_model

    return load_model(path, arch=arch, num_classes=num_classes, trust_pickle=trust_pickle, input_shape=parse_input_shapes(input_shape))


def data_options(model, **raw: Any):
    """The user's data flags as the model family's ``DataOptions`` (a flag for another family is refused)."""
    from servopt.families import family_of

    for key in ("mean", "std"):
        if isinstance(raw.get(key), str):
            raw[key] = parse_floats3(raw[key], f"--{key}")
    family = family_of(model.spec)
    return family, family.data_options(raw)


def open_data(model, **raw: Any):
    """The evaluation data for ``model`` (its family reads it), with the spec updated from what the data taught, and
    what to tell the user when no data was given (empty when it was)."""
    family, options = data_options(model, **raw)
    dataset, spec = family.read_eval(model.spec, options)
    model.spec = spec
    return dataset, "" if family.has_data(options) else family.no_data_note
