"""Passes turn one artifact into another (torch → ONNX, ONNX → INT8 ONNX, ONNX → OpenVINO IR …).

Each pass declares its parameters once as a pydantic model, which both
validates them and documents them (Olive's design). Passes register by name, so
a new one is one file in ``servopt/passes/`` imported by ``passes/__init__``.
Built artifacts are cached by a content hash of (source model, pass chain,
parameters, and the content of the calibration and tuning data for a pass that
reads them): a rerun never rebuilds, a rerun on other data does, and a kill
mid-build leaves no half folder (its ``.tmp-*`` folder is removed by the next
build of that step on the same host).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from servopt.contracts import Artifact, Contract
from servopt.cpu import Int8Kernel
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.families.base import Family, family_of
from servopt.models.sources import LoadedModel
from servopt.passes.int8_overflow import u8s8_overflow
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
    log: Callable[[str], None] = field(default=lambda _m: None)
    calibration_path: str | None = None  # the same data saved, for a build in another process
    tuning_path: str | None = None

    @property
    def family(self) -> Family:
        return family_of(self.source.spec)


class PassOutput(Contract):
    """What a pass wrote into its folder."""

    format: str
    file: str | None = None  # the model file, relative to the pass's folder
    size_file: str | None = None  # a file to measure the size of (torch variants), relative likewise
    report: dict[str, Any] | None = None


class Pass(ABC):
    name: ClassVar[str]
    input_format: ClassVar[str]  # torch | onnx
    output_format: ClassVar[str]  # onnx | openvino | torch
    Params: ClassVar[type[PassParams]] = PassParams
    # A pass that times candidates while it builds (the accuracy-aware search times float islands): the sweep builds
    # it alone on the machine, never beside another build.
    times_itself: ClassVar[bool] = False
    # Seconds a build of this pass takes beyond a plain one, where that is long (a search, an accuracy-control loop):
    # what a time budget plans with before a run on this CPU has timed it (the image demo, 2 AVX2 cores).
    slow_seconds: ClassVar[float] = 0.0
    # Whether what it builds depends on the calibration or tuning data (``BuildContext.calibration`` / ``tuning``): its
    # cache key then includes their content (``Artifact.data_key``). True unless a pass says otherwise, so a pass that
    # reads data can never be handed a model built on other data; a pass that reads none sets False and is not rebuilt
    # when the data change.
    reads_data: ClassVar[bool] = True
    # A step of an INT8 recipe (a quantizer, or a step that prepares one, like cross-layer equalization): the report's
    # INT8 table says, in ``describe``'s words, what each such step of a variant did to keep its accuracy.
    int8_recipe: ClassVar[bool] = False

    @classmethod
    def describe(cls, params: Any, report: dict[str, Any] | None = None) -> str:
        """This step in words, one line, for the report: what it did with ``params`` and, for a pass whose build report
        says what it chose (a search), with that ``report`` (None or {} from an older run: still words). The default
        names the pass and each parameter that differs from its default, by its field description."""
        changed = [f"{f.description or name}: {getattr(params, name)}" for name, f in type(params).model_fields.items()
                   if getattr(params, name) != f.get_default(call_default_factory=True)]
        return cls.name + (f" ({'; '.join(changed)})" if changed else "")

    @classmethod
    def int8_kernel(cls, params: Any) -> Int8Kernel | None:
        """The INT8 product its model holds (``cpu.Int8Kernel``), known before it is built: the race ranks recipes
        by what the CPU computes fast and right (``CpuFeatures.int8_trouble``). None: not a quantizer, or it cannot
        tell."""
        return None

    @classmethod
    def read_params(cls, raw: dict[str, Any]) -> PassParams:
        """A record's stored parameters as this pass's model, defaults filled in. A record of an older servopt whose
        parameters this version no longer takes is read as far as it goes (unknown names dropped), never refused: a
        report re-renders any run."""
        try:
            return cls.Params.model_validate(raw)
        except ValidationError:
            return cls.Params.model_construct(**{k: v for k, v in raw.items() if k in cls.Params.model_fields})

    @abstractmethod
    def run(self, artifact: Artifact, params: Any, out_dir: Path, ctx: BuildContext) -> PassOutput:
        """Write the new artifact into ``out_dir`` and say what it is."""


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


def dataset_digest(data: str | Path | Dataset) -> str:
    """A digest of a dataset's content: every array's name, dtype, shape and bytes (inputs, labels, lengths, extras), in
    name order. Not its path, its file's bytes or its description: the same samples saved elsewhere digest alike, other
    samples or another count of them digest differently."""
    if isinstance(data, Dataset):
        arrays = {f"input:{k}": v for k, v in data.inputs.items()} | {f"extra:{k}": v for k, v in data.extras.items()}
        arrays |= {k: v for k, v in (("labels", data.labels), ("lengths", data.lengths)) if v is not None}
    else:
        with np.load(Path(data)) as z:
            arrays = {k: z[k] for k in z.files if k != "__meta__"}
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def build_data_key(calibration: str | Path | Dataset | None, tuning: str | Path | Dataset | None) -> str | None:
    """The identity of the data a build may read (None: it has none): what ``Artifact.data_key`` carries."""
    if calibration is None and tuning is None:
        return None
    parts = [f"{what}:{dataset_digest(d) if d is not None else '-'}" for what, d in (("calibration", calibration), ("tuning", tuning))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def source_artifact(model: LoadedModel, data_key: str | None = None) -> Artifact:
    """The artifact a chain starts from, with a content hash of the source files and the key of the data its passes may
    read (``build_data_key``)."""
    digest = file_hash(model.files())
    if model.kind == "onnx":
        return Artifact(format="onnx", path=str(model.path), hash=digest, data_key=data_key)
    return Artifact(format="torch", ref=model.ref(), hash=digest, data_key=data_key)


def chain_data_key(start: Artifact, chain: list[tuple[str, dict]]) -> str | None:
    """The data key that shapes what ``chain`` builds from ``start``: ``start.data_key`` when one of its passes reads
    data, else None. A result key folds it in, so a variant built on other data is measured again."""
    return start.data_key if any(get_pass(name).reads_data for name, _ in chain) else None


def resolve(artifact_dir: Path, start: Artifact) -> Artifact:
    """The artifact a cache folder holds (``artifact.json`` as ``build_chain`` wrote it)."""
    meta = json.loads((artifact_dir / "artifact.json").read_text())
    return Artifact(
        format=meta["format"], path=str(artifact_dir / meta["file"]) if meta.get("file") else None,
        ref=start.ref if meta["format"] == "torch" else None,  # a torch pass keeps the source and transforms it on load
        size_file=str(artifact_dir / Path(meta["size_file"]).name) if meta.get("size_file") else None,
        hash=meta["hash"], built_by=meta.get("pass"), params=meta.get("params"), report=meta.get("report"),
        data_key=start.data_key)


def _step_dir(artifact: Artifact, name: str, params: dict, cache: Path) -> tuple[Path, PassParams]:
    """Where one step of a chain is cached: a content hash of its input, the pass and its parameters."""
    p = get_pass(name)
    parsed = validate_params(name, params)
    if artifact.format != p.input_format:
        raise UserError(f"pass {name} takes {p.input_format}, got {artifact.format}", fix="reorder the chain")
    identity = [artifact.hash, name, parsed.model_dump()] + ([artifact.data_key] if p.reads_data and artifact.data_key else [])
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache / f"{name}-{key}", parsed


def cached_artifact(start: Artifact, chain: list[tuple[str, dict]], cache: Path) -> Artifact | None:
    """The chain's result when every step is already built, else None (nothing is built)."""
    artifact = start
    for name, params in chain:
        out, _ = _step_dir(artifact, name, params, cache)
        if not (out / "artifact.json").exists():
            return None
        artifact = resolve(out, start)
    return artifact


def _publish(tmp: Path, out: Path) -> None:
    """Rename a finished build folder into place: it appears whole or not at all. When another process published the
    same step meanwhile, its folder is kept (it may be in use) and this one dropped."""
    for _ in range(2):
        try:
            tmp.rename(out)
            return
        except OSError:
            if (out / "artifact.json").exists():
                shutil.rmtree(tmp, ignore_errors=True)
                return
            shutil.rmtree(out, ignore_errors=True)  # a folder of an older servopt, left without artifact.json
    tmp.rename(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_builds(cache: Path, name: str, key: str) -> list[Path]:
    """Remove the ``.tmp-*`` folders of this step left by builds on this host whose process is gone (a kill mid-build);
    another host's, or a live process's, are left alone. Returns what it removed."""
    prefix = f".tmp-{name}-{key}-{socket.gethostname()}-"
    stale = [t for t in cache.glob(f"{prefix}*")
             if t.name[len(prefix):].isdigit() and int(t.name[len(prefix):]) != os.getpid() and not _alive(int(t.name[len(prefix):]))]
    for t in stale:
        shutil.rmtree(t, ignore_errors=True)
    return stale


def build_chain(start: Artifact, chain: list[tuple[str, dict]], cache: Path, ctx: BuildContext) -> Artifact:
    """Apply ``chain`` to ``start``, reusing every step already built under ``cache``."""
    artifact = start
    for name, params in chain:
        p = get_pass(name)
        out, parsed = _step_dir(artifact, name, params, cache)
        key = out.name.rsplit("-", 1)[1]
        remove_stale_builds(cache, name, key)
        if not (out / "artifact.json").exists():
            # A folder of this process's own: builds running in parallel (a distributed sweep) may build the same step.
            tmp = cache / f".tmp-{name}-{key}-{socket.gethostname()}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            ctx.log(f"building {name}")
            produced = p.run(artifact.opened(), parsed, tmp, ctx)
            if p.int8_recipe and produced.format == "onnx" and produced.file:
                # every INT8 recipe's ONNX model says whether a CPU without VNNI computes it as it was verified here
                produced.report = {**u8s8_overflow(str(tmp / produced.file)), **(produced.report or {})}
            write_json_atomic(tmp / "artifact.json", {**produced.model_dump(), "pass": name, "params": parsed.model_dump(), "hash": key})
            _publish(tmp, out)
        artifact = resolve(out, start)
    return artifact
