"""A model as the server sees it: an ONNX or OpenVINO artifact, its spec, labels and preprocessing.

The serving path never imports torch and never unpickles: it opens ONNX Runtime
or OpenVINO artifacts only (a test proves torch stays unimported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from servopt.errors import UserError
from servopt.spec import ModelSpec

SERVABLE_RUNTIMES = ("onnxruntime", "onnxruntime-cuda", "openvino")


@dataclass
class ServedModel:
    name: str
    artifact: dict
    runtime: str
    options: dict
    spec: ModelSpec
    instances: int = 1
    sessions: list = field(default_factory=list)
    objective: str | None = None  # the target's, when served from a run directory

    def load(self) -> None:
        from servopt.runtimes.base import open_session

        options = dict(self.options)
        if self.runtime.startswith("onnxruntime"):
            options.setdefault("allow_spinning", False)  # the event loop shares these cores
        self.sessions = [open_session(self.artifact, self.runtime, options) for _ in range(max(1, self.instances))]
        first = self.spec.inputs
        warm = {t.name: np.zeros(t.concrete_shape(1, {d: 8 for d in _named_dims(t.shape)}), dtype=t.dtype) for t in first}
        for s in self.sessions:
            s.run(warm)

    @property
    def output_name(self) -> str:
        return self.spec.outputs[0].name if self.spec.outputs else "output"

    def runtime_options_cli(self) -> list[str]:
        """The ``servopt serve`` flags that reproduce these runtime options (for packaging)."""
        flags = {"graph_optimization_level": "--graph-level", "intra_op_threads": "--threads", "hint": "--hint"}
        return [x for k, v in self.options.items() if k in flags for x in (flags[k], str(v))]


def _named_dims(shape: list) -> list[str]:
    return [d for d in shape[1:] if isinstance(d, str)]


def from_file(path: Path, name: str | None, runtime: str | None = None, options: dict | None = None) -> ServedModel:
    """An ONNX file (ONNX Runtime by default) or an OpenVINO IR ``.xml`` (OpenVINO)."""
    from servopt.models.sources import load_model

    suffix = path.suffix.lower()
    if not path.exists():
        raise UserError(f"{path} does not exist", fix="check the path")
    if suffix == ".onnx":
        spec = load_model(path).spec
        fmt, runtime = "onnx", runtime or "onnxruntime"
    elif suffix == ".xml":
        spec = _openvino_spec(path)
        fmt, runtime = "openvino", runtime or "openvino"
        if runtime != "openvino":
            raise UserError("an OpenVINO IR runs on the openvino runtime only", fix="drop --runtime or use --runtime openvino")
    else:
        raise UserError(f"servopt serves ONNX or OpenVINO artifacts (no pickles, no torch), not {path.name}",
                        fix="export it first (`servopt export`) or serve a run directory (`servopt serve runs/NAME --target T`)")
    if runtime not in SERVABLE_RUNTIMES:
        raise UserError(f"runtime {runtime} cannot serve", fix=f"use one of {SERVABLE_RUNTIMES}")
    return ServedModel(name or path.stem, {"format": fmt, "path": str(path)}, runtime, options or {}, spec)


def _openvino_spec(path: Path) -> ModelSpec:
    import openvino as ov

    from servopt.spec import TensorSpec

    model = ov.Core().read_model(str(path))

    def spec(port) -> TensorSpec:
        dims = [d.get_length() if d.is_static else ("batch" if i == 0 else None) for i, d in enumerate(port.get_partial_shape())]
        return TensorSpec(port.get_any_name(), port.get_element_type().to_dtype().name, dims)

    return ModelSpec(inputs=[spec(p) for p in model.inputs], outputs=[spec(p) for p in model.outputs])


def from_run(run_dir: Path, target: str | None, variant: str | None) -> ServedModel:
    """The variant recommended for ``target`` in a run directory (or the one named)."""
    from servopt.optimize.rundir import load_run

    summary, run_records = load_run(run_dir)
    if not summary:
        raise UserError(f"{run_dir} has no summary.json", fix="run `servopt optimize … --out DIR` to the end first")
    records = {r["name"]: r for r in run_records}
    if variant is None:
        names = [t["target"]["name"] for t in summary["targets"]]
        if target is None:
            raise UserError("which target's variant should be served?", fix=f"pass --target (one of {names}) or --variant")
        entry = next((t for t in summary["targets"] if t["target"]["name"] == target), None)
        if entry is None:
            raise UserError(f"no target {target!r} in {run_dir}", fix=f"one of: {', '.join(names)}")
        variant = entry.get("recommended")
        if variant is None:
            raise UserError(f"no variant meets target {target!r} ({entry['reason']})", fix="pick one with --variant NAME")
    rec = records.get(variant)
    if rec is None:
        raise UserError(f"no variant {variant!r} in {run_dir}", fix=f"one of: {', '.join(records)}")
    if rec["runtime"] not in SERVABLE_RUNTIMES or rec.get("artifact_format") not in ("onnx", "openvino"):
        raise UserError(f"variant {variant} runs on {rec['runtime']}; the server runs ONNX Runtime and OpenVINO artifacts only",
                        fix="serve an ONNX/OpenVINO variant with --variant (see report.md)")
    config = json.loads((run_dir / "config.json").read_text())
    if "spec" in config:  # labels and preprocessing of the run's source model
        spec = ModelSpec.from_dict(config["spec"])
    elif rec["artifact_format"] == "onnx":
        from servopt.models.sources import load_model

        spec = load_model(Path(rec["artifact"])).spec
    else:
        raise UserError(f"{run_dir} was made by an older servopt (no model spec stored)", fix="rerun the optimize command")
    model = ServedModel(Path(config["model"]).stem, {"format": rec["artifact_format"], "path": rec["artifact"]}, rec["runtime"],
                        rec.get("options") or {}, spec)
    entry = next((t for t in summary["targets"] if t["target"]["name"] == target), None)
    model.objective = entry["target"]["objective"] if entry else None
    return model


def apply_instance_defaults(model: ServedModel, instances: int | None, threads: int | None) -> None:
    """Instances and threads per instance. For a throughput objective, two single-thread instances per 2 cores
    (Triton's CPU default is 2 instances): batches overlap with request handling, and one-thread sessions waste
    nothing on intra-op synchronisation (measured: served 79-81 % of offline throughput vs 58-77 % with one
    2-thread instance, benchmarks/serve_bench.py). For latency, one instance with every core."""
    import os

    cores = os.cpu_count() or 1
    if instances is None:
        instances = 2 if model.objective == "throughput" and cores >= 2 else 1
    model.instances = instances
    if threads is None and instances > 1:
        threads = max(1, cores // instances)
    if threads:
        key = "intra_op_threads" if model.runtime.startswith("onnxruntime") else "threads"
        model.options = {**model.options, key: threads}
