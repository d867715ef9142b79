"""Passes turn one artifact into another (torch → ONNX, ONNX → INT8 ONNX, ONNX → OpenVINO IR …).

Each pass declares its parameters once as a pydantic model, which both
validates them and documents them (Olive's design). Passes register by name, so
a new one is one file in ``servopt/passes/`` imported by ``passes/__init__``.
Built artifacts are cached by a content hash of (source model, pass chain,
parameters): a rerun never rebuilds, and a kill mid-build leaves no half folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.models.sources import LoadedModel
from servopt.registry import Registry
from servopt.results import write_json_atomic


class PassParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class BuildContext:
    """What a pass may use besides its input artifact."""

    source: LoadedModel
    calibration: Dataset | None = None  # drawn from the validation split
    tuning: Dataset | None = None  # labelled data for accuracy-aware passes (validation split)
    reference_top1: float | None = None
    log: Callable[[str], None] = field(default=lambda _m: None)


class Pass(ABC):
    name: ClassVar[str]
    input_format: ClassVar[str]  # torch | onnx
    output_format: ClassVar[str]  # onnx | openvino | torch
    Params: ClassVar[type[PassParams]] = PassParams

    @abstractmethod
    def run(self, artifact: dict, params: Any, out_dir: Path, ctx: BuildContext) -> dict:
        """Write the new artifact into ``out_dir``; return ``{"format", "file", "report"?}``."""


PASSES: Registry[Pass] = Registry("pass", "servopt.passes")
register_pass = PASSES.register
get_pass = PASSES.get


def validate_params(name: str, params: dict) -> PassParams:
    p = get_pass(name)
    try:
        return p.Params(**params)
    except ValidationError as e:
        raise UserError(f"bad parameters for pass {name}: {e.errors()[0]['loc']} {e.errors()[0]['msg']}",
                        fix=f"see `{name}` parameters: {list(p.Params.model_fields)}") from e


def file_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def source_artifact(model: LoadedModel) -> dict:
    """The artifact a chain starts from, with a content hash of the source files."""
    digest = file_hash(model.files())
    if model.kind == "onnx":
        return {"format": "onnx", "path": str(model.path), "hash": digest}
    return {"format": "torch", "ref": model.ref(), "hash": digest}


def resolve(artifact_dir: Path) -> dict:
    meta = json.loads((artifact_dir / "artifact.json").read_text())
    meta["path"] = str(artifact_dir / meta["file"]) if meta.get("file") else meta.get("path")
    return meta


def build_chain(start: dict, chain: list[tuple[str, dict]], cache: Path, ctx: BuildContext) -> dict:
    """Apply ``chain`` to ``start``, reusing every step already built under ``cache``."""
    artifact = start
    for name, params in chain:
        p = get_pass(name)
        parsed = validate_params(name, params)
        if artifact["format"] != p.input_format:
            raise UserError(f"pass {name} takes {p.input_format}, got {artifact['format']}", fix="reorder the chain")
        key = hashlib.sha256(json.dumps([artifact["hash"], name, parsed.model_dump()], sort_keys=True).encode()).hexdigest()[:16]
        out = cache / f"{name}-{key}"
        if not (out / "artifact.json").exists():
            tmp = cache / f".tmp-{name}-{key}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            ctx.log(f"building {name}")
            produced = p.run(artifact, parsed, tmp, ctx)
            produced.setdefault("file", None)
            write_json_atomic(tmp / "artifact.json", {**produced, "pass": name, "params": parsed.model_dump(), "hash": key})
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)  # the folder appears whole or not at all
        artifact = resolve(out)
        if artifact.get("ref") is None and artifact["format"] == "torch":
            artifact["ref"] = start["ref"]
        if artifact.get("size_file"):
            artifact["size_file"] = str(out / Path(artifact["size_file"]).name)
    return artifact
