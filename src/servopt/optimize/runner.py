"""``servopt optimize``: build every variant, verify it, benchmark it, decide per target.

Run directory (everything a rerun needs to resume):

    config.json            the settings of the run
    data/eval.npz          evaluation inputs + labels; data/calib.npz, data/tune.npz from the validation split
    reference_outputs.npy  the original model's outputs on eval.npz
    artifacts/<pass>-<hash>/   built models, cached by content hash of (source, pass chain, parameters)
    work/<variant>/        worker logs and job files
    results.jsonl          one record per variant, appended atomically
    interleave.json        the side-by-side re-measure of the top candidates with the reference
    summary.json, report.md, report.html, profiles/

A killed run leaves at most a temporary folder or a torn last line; both are
ignored, so running the same command again skips everything finished.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from servopt.bench.environment import environment, gpu_present
from servopt.bench.protocol import Protocol
from servopt.bench.run import measure
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.models.sources import LoadedModel, artifact_size_mb
from servopt.optimize.decide import decide, interleave_candidates, pareto_front
from servopt.optimize.interleave import measure_side_by_side
from servopt.optimize.rundir import session_of
from servopt.optimize.targets import Target
from servopt.optimize.variants import Variant, catalogue, is_linear_heavy, select
from servopt.passes.base import BuildContext, build_chain, file_hash, source_artifact
from servopt.results import RESULT_SCHEMA, append_jsonl, read_jsonl, write_json_atomic
from servopt.runtimes.base import get_runtime

SUMMARY_SCHEMA = "servopt.summary/1"
REFERENCE_ORT = "ort-fp32"


def sweep_protocol() -> Protocol:
    """Shorter phases than `servopt bench` so a 25-variant sweep fits in minutes; the close calls are
    re-measured interleaved with longer phases before deciding."""
    return Protocol(min_runs=50, min_seconds=1.0, batch_min_runs=8, batch_min_seconds=1.0, warmup=10)


@dataclass
class Progress:
    """Callbacks the CLI turns into rich progress bars; silent by default."""

    start: Callable[[int], None] = lambda total: None
    step: Callable[[str], None] = lambda message: None
    advance: Callable[[], None] = lambda: None
    note: Callable[[str], None] = lambda message: None


@dataclass
class OptimizeConfig:
    out: Path
    targets: list[Target]
    variants: list[str] | None = None
    include_all: bool = False
    protocol: Protocol = field(default_factory=sweep_protocol)
    # Close calls are re-measured with longer phases than the sweep's.
    interleave_protocol: Protocol = field(default_factory=lambda: Protocol(min_runs=50, min_seconds=1.5, batch_min_runs=8,
                                                                          batch_min_seconds=1.5))
    interleave_rounds: int = 3
    note: str = ""  # shown at the top of the report (the demo says what its data stands in for)
    verify_max_drop: float = 5.0
    verify_min_agreement: float = 0.9


def _linear_heavy(model: LoadedModel) -> bool:
    if model.kind == "onnx":
        return is_linear_heavy(str(model.path))
    import torch

    mods = list(model.torch_module().modules())
    return sum(isinstance(m, torch.nn.Linear) for m in mods) > sum(isinstance(m, torch.nn.Conv2d) for m in mods)


def optimize(model: LoadedModel, eval_data: Dataset, calib_data: Dataset | None, tune_data: Dataset | None,
             cfg: OptimizeConfig, progress: Progress | None = None) -> dict:
    progress = progress or Progress()
    out = cfg.out = cfg.out.resolve()  # absolute paths in every record: readable from any working directory
    (out / "data").mkdir(parents=True, exist_ok=True)
    eval_path = out / "data" / "eval.npz"
    eval_data.save(eval_path)
    data_hash = file_hash([eval_path])
    start = source_artifact(model)
    drop = min((t.max_accuracy_drop for t in cfg.targets), default=1.0)
    all_variants = catalogue(model, linear_heavy=_linear_heavy(model), accuracy_drop=drop)
    chosen = select(all_variants, cfg.variants, cfg.include_all)
    reference_name = "torch-eager" if model.is_torch else REFERENCE_ORT
    ref_variant = next(v for v in all_variants if v.name == reference_name)
    if ref_variant not in chosen:
        chosen.insert(0, ref_variant)  # the original must be measured: everything is verified against it
    chosen.sort(key=lambda v: v.name != reference_name)
    write_json_atomic(out / "config.json", {
        "model": str(model.path), "model_kind": model.kind, "source_hash": start["hash"], "spec": model.spec.to_dict(),
        "targets": [t.model_dump() for t in cfg.targets], "variants": [v.name for v in chosen],
        "protocol": cfg.protocol.to_dict(), "data": {"eval": eval_data.source, "samples": len(eval_data)},
        "left_out": [{"name": v.name, "why": v.description} for v in all_variants if v not in chosen],
        "note": cfg.note,
    })
    ctx = BuildContext(source=model, calibration=calib_data, tuning=tune_data, log=progress.step)
    results_path = out / "results.jsonl"
    done = {r["key"]: r for r in read_jsonl(results_path)}
    progress.start(len(chosen))
    records: list[dict] = []
    reference: dict | None = None
    for v in chosen:
        key = v.key(start["hash"], cfg.protocol.to_dict(), data_hash)
        if key in done:
            rec = done[key]
            progress.note(f"{v.name}: cached ({rec['status']})")
        else:
            progress.step(f"{v.name}")
            rec = _run_variant(v, key, model, start, eval_path, out, ctx, cfg, reference, progress)
            append_jsonl(results_path, rec)
        records.append(rec)
        if v.name == reference_name:
            if rec["status"] != "ok":
                raise UserError(f"the original model could not be measured: {rec.get('error')}", fix="check the model and data")
            reference = rec
        progress.advance()
    return finish(out, cfg, records, reference, eval_path, progress)


def _run_variant(v: Variant, key: str, model: LoadedModel, start: dict, eval_path: Path, out: Path, ctx: BuildContext,
                 cfg: OptimizeConfig, reference: dict | None, progress: Progress) -> dict:
    base = {"schema": RESULT_SCHEMA, "key": key, "name": v.name, "variant": v.name, "group": v.group, "runtime": v.runtime,
            "chain": v.chain, "options": v.options, "env": v.env, "description": v.description, "needs_gpu": v.needs_gpu,
            "batch_size": cfg.protocol.batch_size, "size_mb": None, "accuracy": None, "latency_ms": None,
            "throughput_ips": None, "cold_start_s": None, "peak_rss_mb": None, "environment": None}
    ok, why = get_runtime(v.runtime).available()
    if v.needs_gpu and not gpu_present():
        ok, why = False, why or "no NVIDIA GPU on this machine"
    if not ok:
        return {**base, "status": "skipped", "error": why}
    t0 = time.perf_counter()
    try:
        artifact = build_chain(start, v.chain, out / "artifacts", ctx)
    except Exception as e:  # noqa: BLE001 - a variant that cannot be built is recorded and the sweep goes on
        msg = e.problem if isinstance(e, UserError) else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        (out / "work" / v.name).mkdir(parents=True, exist_ok=True)
        (out / "work" / v.name / "build_error.txt").write_text(traceback.format_exc())
        return {**base, "status": "failed", "stage": "build", "error": f"build failed: {msg}"}
    build_s = time.perf_counter() - t0
    build_report = None
    if artifact.get("path"):
        meta = Path(artifact["path"]).parent / "artifact.json"
        build_report = json.loads(meta.read_text()).get("report") if meta.exists() else None
    ref_outputs = out / "reference_outputs.npy"
    is_ref = reference is None
    gate = None if is_ref else {
        "reference_top1": (reference.get("accuracy") or {}).get("top1"), "max_drop_points": cfg.verify_max_drop,
        "min_agreement": cfg.verify_min_agreement,
        # Embeddings have no labels to count: their verification is cosine similarity to the original.
        **({"min_cosine": 0.99} if model.spec.task == "embedding" else {}),
    }
    result = measure(
        name=v.name, runtime=v.runtime, artifact={k: val for k, val in artifact.items() if k != "report"}, options=v.options,
        spec=model.spec.to_dict(), task=model.spec.task, data_path=eval_path, reference=None if is_ref else ref_outputs,
        proto=cfg.protocol, size_mb=artifact_size_mb(artifact), workdir=out / "work" / v.name,
        save_outputs=ref_outputs if is_ref else None, env=v.env, gate=gate,
    )
    result.update({k: val for k, val in base.items() if k not in result})
    result.update(key=key, artifact=artifact.get("path") or artifact.get("ref", {}).get("path"), artifact_format=artifact["format"],
                  build_s=round(build_s, 2), build_report=build_report, stage="measure" if result["status"] != "ok" else None)
    return result


def run_interleave(out: Path, names: list[str], records: list[dict], eval_path: Path, cfg: OptimizeConfig) -> dict | None:
    """Candidates and the ORT reference, side by side in one process (cached by the set measured)."""
    by_name = {r["name"]: r for r in records if r["status"] == "ok"}
    if REFERENCE_ORT not in by_name:
        return None
    names = [n for n in names if n in by_name and n != REFERENCE_ORT] + [REFERENCE_ORT]
    cache_key = json.dumps([sorted(by_name[n]["key"] for n in names), cfg.interleave_rounds, cfg.interleave_protocol.to_dict()])
    path = out / "interleave.json"
    if path.exists():
        previous = json.loads(path.read_text())
        if previous.get("cache_key") == cache_key:
            return previous
    env: dict = {}
    for n in names:  # torch variants want their allocator settings; the others do not mind them
        env.update(by_name[n].get("env") or {})
    result = measure_side_by_side([session_of(by_name[n], out) for n in names], REFERENCE_ORT, eval_path, cfg.interleave_protocol,
                                  cfg.interleave_rounds, out / "work", env)
    if "error" not in result:
        result["cache_key"] = cache_key
        write_json_atomic(path, result)
    return result


def finish(out: Path, cfg: OptimizeConfig, records: list[dict], reference: dict | None, eval_path: Path,
           progress: Progress) -> dict:
    """Decide per target (after the interleaved re-measure), then write summary.json and the reports."""
    progress.step("re-measuring the top candidates side by side with the reference")
    names = interleave_candidates(cfg.targets, records, reference)
    interleaved = run_interleave(out, names, records, eval_path, cfg) if names else None
    if interleaved and "error" in interleaved:
        progress.note(interleaved["error"])
        interleaved = None
    decisions = [decide(t, records, reference, interleaved) for t in cfg.targets]
    by_name = {r["name"]: r for r in records}
    summary = {
        "schema": SUMMARY_SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run_dir": str(out),
        "reference": reference["name"] if reference else None,
        "reference_ort": REFERENCE_ORT if REFERENCE_ORT in by_name else None,
        "targets": [
            {**d, "result": by_name.get(d.get("recommended") or "")} for d in decisions
        ],
        "pareto_front": pareto_front(records, reference),
        "interleaved": interleaved,
        "counts": {s: sum(r["status"] == s for r in records) for s in ("ok", "failed", "skipped")},
        "environment": environment(),
    }
    write_json_atomic(out / "summary.json", summary)
    from servopt.optimize.report import write_reports

    progress.step("profiling the recommended variants and writing the report")
    write_reports(out, summary, records)
    return summary
