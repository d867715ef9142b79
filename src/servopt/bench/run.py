"""``servopt bench``: measure one model under one or more runtimes with the protocol.

The first runtime measured is the reference: its outputs are saved and every
other runtime is compared against them on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field

from servopt.bench.jobs import ColdStartJob, MeasureJob, OpenSpec
from servopt.bench.launcher import launch
from servopt.bench.protocol import Protocol
from servopt.contracts import BENCH_SCHEMA, Artifact, ColdStart, Contract, Measured, Record
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.models.sources import LoadedModel, artifact_size_mb
from servopt.runtimes.base import get_runtime
from servopt.spec import ModelSpec


class DataSummary(Contract):
    source: str
    samples: int
    labelled: bool
    skipped: dict[str, int] = Field(default_factory=dict)


class BenchReport(Contract):
    schema_: str = Field(BENCH_SCHEMA, alias="schema")
    model: str
    model_kind: str
    data: DataSummary
    protocol: Protocol
    export: dict[str, Any] | None = None
    results: list[Record]


def measure(job: MeasureJob, spec: ModelSpec, workdir: Path, deadline: float | None = None) -> Record:
    """Verify and time one (artifact, runtime, options) in a fresh process, then its cold start in another;
    ``deadline``: a time budget's end (``launcher.OutOfTime`` past it)."""
    get_runtime(job.session.runtime).parse_options(job.session.options)  # a bad option fails before any process starts
    launched = launch(job, workdir / "measure", deadline=deadline)
    measured: Measured = launched.result if launched.result is not None else Measured(status="failed", error=launched.error)
    cold = None
    if measured.status == "ok" and job.protocol.cold_start:
        started = launch(ColdStartJob(session=job.session, spec=spec, env=job.env, python=job.python), workdir / "coldstart")
        cold = (started.result.model_copy(update={"total_s": started.ready_s}) if started.result is not None
                else ColdStart(error=started.error))
    return Record(name=job.session.name, runtime=job.session.runtime, options=job.session.options, env=job.env,
                  status=measured.status, error=measured.error, artifact=job.session.artifact,
                  size_mb=round(artifact_size_mb(job.session.artifact), 4), batch_size=job.protocol.batch_size,
                  cold_start=cold, **measured.model_dump(exclude={"status", "error"}))


def bench_model(
    model: LoadedModel,
    data: Dataset,
    runtimes: list[str],
    proto: Protocol,
    workdir: Path,
    *,
    runtime_options: dict[str, dict] | None = None,
    opset: int = 18,
    on_progress: Callable[[str], None] = lambda _m: None,
) -> BenchReport:
    workdir.mkdir(parents=True, exist_ok=True)
    data_path = workdir / "data.npz"
    data.save(data_path)
    onnx_path: Path | None = model.path if model.kind == "onnx" else None
    export_report = None
    results: list[Record] = []
    reference: Path | None = None
    for rt_name in runtimes:
        rt = get_runtime(rt_name)
        ok, why = rt.available()
        if not ok:
            results.append(Record(name=rt_name, runtime=rt_name, status="skipped", error=why))
            continue
        if "torch" in rt.artifact_formats and model.is_torch:
            artifact = Artifact(format="torch", ref=model.ref())
        elif "onnx" in rt.artifact_formats:
            if onnx_path is None:
                from servopt.export import export_onnx

                on_progress("exporting to ONNX")
                onnx_path = workdir / "model.onnx"
                export_report = export_onnx(model, onnx_path, opset=opset, verify_data=data)
            artifact = Artifact(format="onnx", path=str(onnx_path))
        else:
            raise UserError(f"runtime {rt_name} cannot run a {model.kind} model", fix="pick another --runtime")
        on_progress(f"measuring {rt_name}")
        outputs = workdir / f"outputs-{rt_name}.npy"
        job = MeasureJob(session=OpenSpec(name=f"{model.path.stem}[{rt_name}]", artifact=artifact, runtime=rt_name,
                                          options=(runtime_options or {}).get(rt_name, {})),
                         data=str(data_path), family=model.spec.family_name, reference=str(reference) if reference else None,
                         save_outputs=str(outputs) if reference is None else None, protocol=proto)
        result = measure(job, model.spec, workdir / rt_name)
        if reference is None and result.status == "ok":
            reference = outputs
        results.append(result)
    return BenchReport(model=str(model.path), model_kind=model.kind, protocol=proto, export=export_report, results=results,
                       data=DataSummary(source=data.source, samples=len(data), labelled=data.labels is not None, skipped=data.skipped))
