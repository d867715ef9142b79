"""A model as the server sees it: an artifact, the runtime that opens it, its spec, and why it was chosen.

The serving path never imports torch and never unpickles: only runtimes that
declare themselves ``servable`` open artifacts here (a test proves torch stays
unimported). Three sources: an ONNX / OpenVINO file, a run directory's pick for
a target (or its nearest miss, served deliberately), or a package folder that
``servopt package`` wrote. Every path a package or an ONNX file names (the
artifact, a tokenizer, ONNX external data) must stay inside its folder: a
manifest or model cannot make the server read, or a package copy, a file from
elsewhere on the host.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from servopt.contracts import Artifact, Contract, ModelRef
from servopt.errors import UserError
from servopt.families.base import Family, family_of
from servopt.machine import usable_cores
from servopt.runtimes.base import Runtime, Session, get_runtime
from servopt.spec import ModelSpec, TensorSpec


@dataclass
class ServedModel:
    name: str
    artifact: Artifact
    runtime: str
    options: dict[str, Any]
    spec: ModelSpec
    instances: int = 1
    sessions: list[Session] = field(default_factory=list)
    objective: str | None = None  # the target's, when served from a run directory
    parameters: dict[str, Any] = field(default_factory=dict)  # told to clients in the model's metadata (why this variant)
    solo: Session | None = None  # the variant as measured (every core), for a call that runs alone: see apply_instances
    solo_options: dict[str, Any] | None = None
    # serving settings the run's capacity search found for the target (``capacity_settings``): defaults under the flags,
    # for this machine's cores; ``package`` takes them for the target's instance (``instance_vcpus``)
    found_settings: dict[str, Any] = field(default_factory=dict)
    found_capacity: Any = None
    instance_vcpus: int | None = None
    _family: Family | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def backend(self) -> Runtime:
        return get_runtime(self.runtime)

    @property
    def family(self) -> Family:
        """Looked up once: the data plane asks on every request, and a registry lookup is not free."""
        if self._family is None:
            self._family = family_of(self.spec)
        return self._family

    def load(self) -> None:
        rt = self.backend
        options = rt.serving_options(rt.parse_options(self.options))
        from servopt.runtimes.base import open_session

        self.sessions = [open_session(self.artifact, self.runtime, options) for _ in range(max(1, self.instances))]
        if self.solo_options is not None:
            self.solo = open_session(self.artifact, self.runtime, rt.serving_options(rt.parse_options(self.solo_options)))
        warm = self.warm_feed(1)
        for s in [*self.sessions, *([self.solo] if self.solo else [])]:
            s.run(warm)

    def warm_feed(self, batch: int = 1) -> dict[str, np.ndarray]:
        """Zeros shaped as the model's inputs (named dynamic axes 8 long): what loading runs once per session, and the
        data plane times once to seed its service-time estimate."""
        return {t.name: np.zeros(t.concrete_shape(batch, {d: 8 for d in t.named_dims}), dtype=t.dtype) for t in self.spec.inputs}

    @property
    def output_name(self) -> str:
        return self.spec.outputs[0].name if self.spec.outputs else "output"

    def apply_instances(self, instances: int | None, threads: int | None) -> None:
        """Instances and threads per instance. For a throughput objective, two single-thread instances per 2 cores
        (Triton's CPU default is 2 instances): batches overlap with request handling, and one-thread sessions waste
        nothing on intra-op synchronisation (measured: served 79-81 % of offline throughput vs 58-77 % with one
        2-thread instance, serve_bench.py: docs/benchmarks.md, "Serving (issue 4)"). For latency, one instance with every core.

        When the split is servopt's (no ``threads`` given), one more session keeps the variant's measured options
        (``solo``): a model call that would run alone on an idle server takes it, so a lone request is as fast as the
        report's p50 says instead of running on one core of two (measured: 128 tokens in 18 vs 26 ms)."""
        cores = usable_cores()
        if instances is None:
            instances = 2 if self.objective == "throughput" and cores >= 2 else 1
        self.instances = instances
        rt = self.backend
        measured = rt.parse_options(self.options)
        self.solo_options = None
        if threads is None and instances > 1:
            threads = max(1, cores // instances)
            if rt.thread_option is not None and (getattr(measured, rt.thread_option) or cores) > threads:
                self.solo_options = measured.model_dump(exclude_defaults=True)
        self.options = rt.with_threads(measured, threads).model_dump(exclude_defaults=True)


def _servable(runtime: str, what: str, artifact: Artifact | None = None) -> None:
    rt = get_runtime(runtime)
    if not rt.servable:
        from servopt.runtimes.base import RUNTIMES

        servable = [n for n in RUNTIMES.names() if RUNTIMES.classes[n].servable]
        raise UserError(f"{what} runs on {runtime}, which the server does not run",
                        fix=f"serve a variant on one of {servable} (see report.md), or export it first (`servopt export`)")
    why = rt.serving_refusal(artifact) if artifact is not None else None
    if why:
        raise UserError(f"{what} cannot be served: {why}", fix="serve an ONNX or OpenVINO variant of it (see report.md)")
    if artifact is not None and artifact.format == "onnx" and artifact.path:
        check_external_data(Path(artifact.path))


def inside(folder: Path, relative: str, what: str) -> Path:
    """``folder / relative``, refused unless it stays inside ``folder``: a relative path without ``..`` whose target
    (symbolic links followed) is in the folder. A package or model names its own files, nothing else on the host."""
    parts = Path(relative.replace("\\", "/")).parts
    if not relative or Path(relative).is_absolute() or relative.startswith(("/", "\\")) or ".." in parts:
        raise UserError(f"{what} {relative!r} is not a path inside {folder} (absolute paths and '..' are refused)",
                        fix=f"name it relative to {folder}, as `servopt package` writes it")
    path = folder / relative
    if not path.resolve().is_relative_to(folder.resolve()):
        raise UserError(f"{what} {relative!r} leads outside {folder} (a symbolic link)",
                        fix=f"put the file itself inside {folder}")
    return path


def check_external_data(path: Path) -> None:
    """An ONNX file's external data must lie in the file's folder (ONNX's own rule for the ``location`` field): a
    model naming ``../../secret`` or ``/etc/…`` is refused before any runtime reads it, or a package copies it. A
    file this cannot parse is refused too (fail closed): its external data could not be checked."""
    import onnx

    from servopt.models.sources import external_data

    try:
        proto = onnx.load(str(path), load_external_data=False)
        if not proto.HasField("graph"):  # protobuf reads an empty or truncated file as an empty model
            raise ValueError("no graph")
    except Exception as e:  # protobuf's DecodeError, OSError, …: all mean "not a readable ONNX file"
        raise UserError(f"{path} is not a readable ONNX file ({type(e).__name__}: {e}), so its external data cannot be "
                        "checked", fix=f"re-export the model, or restore {path.name} from where it was built") from e
    for name, location in external_data(proto.graph):
        inside(path.parent, location, f"{path.name}: external data of tensor {name!r} at")


def from_file(path: Path, name: str | None, runtime: str | None = None, options: dict | None = None) -> ServedModel:
    """An ONNX file (ONNX Runtime by default) or an OpenVINO IR ``.xml`` (OpenVINO)."""
    from servopt.models.sources import load_model

    suffix = path.suffix.lower()
    if not path.exists():
        raise UserError(f"{path} does not exist", fix="check the path")
    if suffix == ".onnx":
        loaded = load_model(path)
        # an ONNX sentence encoder in its Hugging Face folder runs as the graph servopt pooled (models.onnx_encoder)
        spec, path = loaded.spec, loaded.path
        fmt, runtime = "onnx", runtime or "onnxruntime"
    elif suffix == ".xml":
        spec = _openvino_spec(path)
        fmt, runtime = "openvino", runtime or "openvino"
    else:
        raise UserError(f"servopt serves ONNX or OpenVINO artifacts (no pickles, no torch), not {path.name}",
                        fix="export it first (`servopt export`) or serve a run directory (`servopt serve runs/NAME --target T`)")
    artifact = Artifact(format=fmt, path=str(path))  # type: ignore[arg-type]
    _servable(runtime, str(path), artifact)
    rt = get_runtime(runtime)
    if fmt not in rt.artifact_formats:
        raise UserError(f"runtime {runtime} cannot open a {fmt} artifact", fix=f"drop --runtime, or use one that opens {fmt}")
    rt.parse_options(options or {})
    return ServedModel(name or path.stem, artifact, runtime, options or {}, spec)


def _openvino_spec(path: Path) -> ModelSpec:
    import openvino as ov

    model = ov.Core().read_model(str(path))

    def spec(port) -> TensorSpec:
        dims = [d.get_length() if d.is_static else ("batch" if i == 0 else None) for i, d in enumerate(port.get_partial_shape())]
        return TensorSpec(name=port.get_any_name(), dtype=port.get_element_type().to_dtype().name, shape=dims)

    return ModelSpec(inputs=[spec(p) for p in model.inputs], outputs=[spec(p) for p in model.outputs])


def from_run(run_dir: Path, target: str | None, variant: str | None, nearest: bool = False) -> ServedModel:
    """The variant recommended for ``target`` in a run directory, the one named, or (``nearest``) the nearest miss of
    a target no variant meets, served deliberately with its shortfall in the model's metadata."""
    from servopt.optimize.rundir import load_config, load_run

    summary, run_records = load_run(run_dir)
    if summary is None and (target or variant is None):  # a named variant is served from a run under way too (its
        # capacity search serves each configuration it tries)
        raise UserError(f"{run_dir} has no summary.json", fix="run `servopt optimize … --out DIR` to the end first")
    parameters: dict[str, Any] = {}
    decision = summary.decision(target) if target and summary else None
    if target and decision is None:
        raise UserError(f"no target {target!r} in {run_dir}", fix=f"one of: {', '.join(d.target.name for d in summary.targets)}")
    # A distributed sweep measured a variant once per kind of node: the target's own kind's record wins (its status).
    kind = decision.result.measured_for if decision and decision.result else None
    records = {r.name: r for r in sorted(run_records, key=lambda r: r.measured_for == kind)}
    if variant is None:
        if decision is None:
            names = [d.target.name for d in summary.targets]
            raise UserError("which target's variant should be served?", fix=f"pass --target (one of {names}) or --variant")
        variant = decision.recommended
        parameters = {"target": decision.target.name, "target_status": decision.status}
        if variant is None and decision.nearest and nearest:
            variant = decision.nearest
            parameters.update(served_as="nearest candidate", shortfall=decision.shortfall or "")
        elif variant is None:
            raise UserError(f"no variant meets target {decision.target.name!r} ({decision.reason})",
                            fix=(f"serve the nearest deliberately with --nearest ({decision.nearest}), or pick one with --variant NAME"
                                 if decision.nearest else "pick one with --variant NAME (see report.md)"))
    rec = records.get(variant)
    if rec is None:
        raise UserError(f"no variant {variant!r} in {run_dir}", fix=f"one of: {', '.join(records)}")
    if rec.status != "ok" or rec.artifact is None:
        raise UserError(f"variant {variant} did not run ({rec.error})", fix="serve a variant that ran (see report.md)")
    _servable(rec.runtime, f"variant {variant}", rec.artifact)
    config = load_config(run_dir)
    if config is None:
        raise UserError(f"{run_dir} has no config.json", fix="rerun the optimize command")
    model = ServedModel(Path(config.model).stem, rec.artifact.opened(), rec.runtime, rec.options, config.spec,
                        parameters={"variant": variant, **parameters})
    model.objective = decision.target.objective if decision else None
    if decision is not None and decision.capacity is not None and decision.capacity.variant == variant:
        model.found_settings = capacity_settings(decision.capacity, usable_cores())
        model.found_capacity, model.instance_vcpus = decision.capacity, decision.target.instance_vcpus
    return model


def capacity_settings(capacity, cores: int) -> dict[str, Any]:
    """The serving configuration a run's capacity search found (``optimize``: the most capacity within the target's
    SLO), for a machine of ``cores``: threads per instance and the batching as found, instances scaled from the cores
    it was found on (one single-thread instance per core found on two cores → eight on an eight-vCPU instance)."""
    cfg = capacity.config
    if cfg is None:
        return {}
    found_on = capacity.cores or cores
    instances = max(1, round(cfg.instances * cores / found_on))
    return {"instances": instances, "threads": cfg.threads, "max_batch": cfg.max_batch, "max_delay_us": cfg.max_delay_us}


class Manifest(Contract):
    """``manifest.json`` of a package: everything ``servopt serve PACKAGE`` needs, nothing it must guess."""

    servopt: str
    name: str
    runtime: str
    runtime_options: dict[str, Any]
    artifact_file: str  # relative to the package folder
    artifact_format: str
    artifact_ref: ModelRef | None = None  # a torch source: its path relative to the package folder
    spec: ModelSpec
    parameters: dict[str, Any] = Field(default_factory=dict)
    serve: dict[str, Any] = Field(default_factory=dict)  # ServeSettings fields the package was made with (batching, instances, threads)
    requirements: list[str] = Field(default_factory=list)


def from_package(folder: Path) -> tuple[ServedModel, dict[str, Any]]:
    """A folder written by ``servopt package``: the model, and the serving settings it was packaged with. Every path
    the manifest names is relative to the folder and stays inside it."""
    path = folder / "manifest.json"
    try:
        manifest = Manifest.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not a servopt package manifest ({str(e).splitlines()[0]})",
                        fix="package with `servopt package`, or serve the run directory or model file") from e
    if manifest.artifact_ref is not None:
        source = inside(folder, manifest.artifact_ref.path, f"{path}: artifact_ref.path")
        ref = manifest.artifact_ref.model_copy(update={"path": str(source)})
        artifact = Artifact(format=manifest.artifact_format, ref=ref)  # type: ignore[arg-type]
    else:
        source = inside(folder, manifest.artifact_file, f"{path}: artifact_file")
        artifact = Artifact(format=manifest.artifact_format, path=str(source))  # type: ignore[arg-type]
    _servable(manifest.runtime, f"package {folder}", artifact)
    spec = manifest.spec
    for key in family_of(spec).serving_files:  # packaged beside the model, named relative to the package
        if spec.preprocessing and spec.preprocessing.get(key):
            spec.preprocessing[key] = str(inside(folder, str(spec.preprocessing[key]), f"{path}: spec.preprocessing.{key}"))
    model = ServedModel(manifest.name, artifact, manifest.runtime, manifest.runtime_options, spec,
                        parameters=manifest.parameters)
    return model, manifest.serve
