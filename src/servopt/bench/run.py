"""``servopt bench``: measure one model under one or more runtimes with the protocol.

The first runtime measured is the reference: its outputs are saved and every
other runtime is compared against them on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from servopt.bench.protocol import Protocol, run_cold_start, run_worker
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.models.sources import LoadedModel, artifact_size_mb
from servopt.results import BENCH_SCHEMA, make_result
from servopt.runtimes.base import get_runtime


def measure(
    *, name: str, runtime: str, artifact: dict, options: dict, spec: dict, task: str, data_path: Path,
    reference: Path | None, proto: Protocol, size_mb: float, workdir: Path, save_outputs: Path | None = None,
    env: dict | None = None, extra: dict | None = None, gate: dict | None = None,
) -> dict:
    """Measure one (artifact, runtime, options) in fresh processes and return a schema result."""
    get_runtime(runtime).validate_options(options)
    job = {
        "artifact": artifact, "runtime": runtime, "options": options, "data": str(data_path),
        "reference": str(reference) if reference else None, "task": task, "protocol": proto.to_dict(),
        "save_outputs": str(save_outputs) if save_outputs else None, "env": env or {}, "gate": gate,
    }
    measured = run_worker(job, workdir)
    cold = None
    if measured.get("status") == "ok" and proto.cold_start:
        cold = run_cold_start({"artifact": artifact, "runtime": runtime, "options": options, "spec": spec, "env": env or {}})
        if measured.get("compile_s"):
            cold["compile_s"] = measured["compile_s"]  # the cold-start process compiled on its first answer too
    return make_result(name=name, runtime=runtime, measured=measured, size_mb=size_mb, batch_size=proto.batch_size,
                       cold=cold, extra=extra)


def bench_model(
    model: LoadedModel,
    data: Dataset,
    runtimes: list[str],
    proto: Protocol,
    workdir: Path,
    *,
    runtime_options: dict | None = None,
    opset: int = 18,
    on_progress: Callable[[str], None] = lambda _m: None,
) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    data_path = workdir / "data.npz"
    data.save(data_path)
    onnx_path: Path | None = model.path if model.kind == "onnx" else None
    export_report = None
    results: list[dict] = []
    reference: Path | None = None
    for rt_name in runtimes:
        rt = get_runtime(rt_name)
        ok, why = rt.available()
        if not ok:
            results.append({"name": rt_name, "runtime": rt_name, "status": "skipped", "error": why})
            continue
        if "torch" in rt.artifact_formats and model.is_torch:
            artifact, size = {"format": "torch", "ref": model.ref()}, model.size_mb()
        elif "onnx" in rt.artifact_formats:
            if onnx_path is None:
                from servopt.export import export_onnx

                on_progress("exporting to ONNX")
                onnx_path = workdir / "model.onnx"
                export_report = export_onnx(model, onnx_path, opset=opset, verify_data=data)
            artifact = {"format": "onnx", "path": str(onnx_path)}
            size = artifact_size_mb(artifact)
        else:
            raise UserError(f"runtime {rt_name} cannot run a {model.kind} model", fix="pick another --runtime")
        on_progress(f"measuring {rt_name}")
        outputs = workdir / f"outputs-{rt_name}.npy"
        result = measure(
            name=f"{model.path.stem}[{rt_name}]", runtime=rt_name, artifact=artifact,
            options=(runtime_options or {}).get(rt_name, {}), spec=model.spec.to_dict(), task=model.spec.task,
            data_path=data_path, reference=reference, proto=proto, size_mb=size, workdir=workdir / rt_name,
            save_outputs=outputs if reference is None else None,
        )
        if reference is None and result["status"] == "ok":
            reference = outputs
        results.append(result)
    return {
        "schema": BENCH_SCHEMA,
        "model": str(model.path),
        "model_kind": model.kind,
        "data": {"source": data.source, "samples": len(data), "labelled": data.labels is not None, "skipped": data.skipped},
        "protocol": proto.to_dict(),
        "export": export_report,
        "results": results,
    }
