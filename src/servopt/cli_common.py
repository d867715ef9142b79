"""Option parsing and loading shared by the CLI commands."""

from __future__ import annotations

from pathlib import Path

from servopt.data.dataset import Dataset, load_image_folder, synthetic_inputs
from servopt.data.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from servopt.errors import UserError
from servopt.models.sources import LoadedModel, load_model


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


def parse_floats3(text: str | None, default: tuple[float, float, float], what: str) -> tuple[float, float, float]:
    if not text:
        return default
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError as e:
        raise UserError(f"{what} must be three numbers, got {text!r}", fix=f"e.g. {what} 0.485,0.456,0.406") from e
    if len(values) != 3:
        raise UserError(f"{what} must be three numbers, got {text!r}", fix=f"e.g. {what} 0.485,0.456,0.406")
    return values  # type: ignore[return-value]


def open_model(path: Path, arch: str | None, num_classes: int | None, trust_pickle: bool,
               input_shape: list[str] | None) -> LoadedModel:
    return load_model(path, arch=arch, num_classes=num_classes, trust_pickle=trust_pickle,
                      input_shape=parse_input_shapes(input_shape))


def open_data(model: LoadedModel, data: Path | None, split: str | None, *, limit: int | None = None,
              strict: bool = False, resize: int | None = None, crop: int | None = None, mean: str | None = None,
              std: str | None = None, synthetic_count: int = 64) -> Dataset:
    """The user's image folder preprocessed for this model, or synthetic inputs from its signature."""
    if data is None:
        return synthetic_inputs(model.spec, count=synthetic_count)
    base = Preprocess.from_dict(model.spec.preprocessing)
    first = model.spec.inputs[0]
    fixed = [d for d in first.shape[2:] if isinstance(d, int)]
    size = crop or (fixed[0] if fixed else base.crop)
    pp = Preprocess(
        resize=resize or (base.resize if crop is None and not fixed else size),
        crop=size,
        mean=parse_floats3(mean, base.mean or IMAGENET_MEAN, "--mean"),
        std=parse_floats3(std, base.std or IMAGENET_STD, "--std"),
    )
    if len(first.shape) != 4:
        raise UserError(f"the model's input {first.name!r} has shape {first.shape}, not an image batch (N, C, H, W)",
                        fix="run without --data to use inputs made from the model's signature")
    dataset = load_image_folder(data, split, pp, limit=limit, strict=strict, input_name=first.name)
    out_dim = model.spec.outputs[0].shape[-1] if model.spec.outputs else None
    if isinstance(out_dim, int) and dataset.labels is not None and len(dataset.class_names or []) > out_dim:
        raise UserError(
            f"the data has {len(dataset.class_names)} classes but the model outputs {out_dim}",
            fix="check --data points at the data the model was trained for (or --num-classes)",
        )
    model.spec.preprocessing = pp.to_dict()
    model.spec.class_names = dataset.class_names
    return dataset
