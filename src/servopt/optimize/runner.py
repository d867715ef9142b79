"""``servopt optimize``: build every variant, verify it, benchmark it, decide per target, profile, report.

Every measurement (each variant, the side-by-side re-measure, each profile) is
a typed job run by ``bench.launcher`` in its own process; this module only
orchestrates and writes the run directory (its layout: ``optimize/rundir``).
A killed run leaves at most a temporary folder or a torn last line; both are
ignored, so running the same command again skips everything finished.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from servopt.bench.jobs import InterleaveJob, MeasureJob, OpenSpec, ProfileJob
from servopt.bench.launcher import launch
from servopt.bench.protocol import Protocol
from servopt.bench.run import measure
from servopt.contracts import ChainStep, Gate, Interleaved, OpProfile, Record
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.families.base import Family, family_of
from servopt.machine import cpu_features, environment, gpu_present, isa_rank
from servopt.models.sources import LoadedModel
from servopt.optimize.decide import decide, interleave_candidates, pareto_front
from servopt.optimize.rundir import LeftOut, RunConfig, Summary, load_profile
from servopt.optimize.targets import Target
from servopt.optimize.variants import Variant, catalogue, is_linear_heavy, left_out_reason, select
from servopt.passes.base import BuildContext, cached_artifact, file_hash, source_artifact
from servopt.passes.build_job import BuildJob
from servopt.results import append_jsonl, parse_record, read_jsonl, write_json_atomic
from servopt.runtimes.base import all_libraries, get_runtime
from servopt.settings import OptimizeSettings

REFERENCE_ORT = "ort-fp32"


def sweep_protocol() -> Protocol:
    """Shorter phases than `servopt bench` so a 25-variant sweep fits in minutes; the close calls are
    re-measured interleaved with longer phases before deciding."""
    return Protocol(min_runs=50, min_seconds=1.0, batch_min_runs=8, batch_min_seconds=1.0, warmup=10)


def interleave_protocol() -> Protocol:
    return Protocol(min_runs=50, min_seconds=1.5, batch_min_runs=8, batch_min_seconds=1.5)


@dataclass
class Progress:
    """Callbacks the CLI turns into rich progress bars; silent by default."""

    start: Callable[[int], None] = lambda total: None
    step: Callable[[str], None] = lambda message: None
    advance: Callable[[], None] = lambda: None
    note: Callable[[str], None] = lambda message: None


@dataclass
class Run:
    """What one run needs besides its settings: the model, its data, and where things go."""

    model: LoadedModel
    eval_data: Dataset
    calibration: Dataset | None
    tuning: Dataset | None
    settings: OptimizeSettings
    targets: list[Target]

    @property
    def out(self) -> Path:
        return self.settings.out.resolve()  # absolute paths in every record: readable from any working directory

    @property
    def family(self) -> Family:
        return family_of(self.model.spec)

    @property
    def protocol(self) -> Protocol:
        """The sweep's protocol, with the family's own axes (a text encoder's batch × length grid, real texts batched
        in arrival order and sorted by length)."""
        base = Protocol.quick() if self.settings.quick else sweep_protocol()
        grid = list(self.family.sweep_grid[:2] if self.settings.quick else self.family.sweep_grid)
        return base.model_copy(update={"grid": grid, "length_batching": self.eval_data.lengths is not None})

    @property
    def interleave_protocol(self) -> Protocol:
        return Protocol.quick() if self.settings.quick else interleave_protocol()

    @property
    def interleave_rounds(self) -> int:
        return 2 if self.settings.quick else self.settings.interleave_rounds


def _linear_heavy(model: LoadedModel) -> bool:
    if model.kind == "onnx":
        return is_linear_heavy(str(model.path))
    import torch

    mods = list(model.torch_module().modules())
    return sum(isinstance(m, torch.nn.Linear) for m in mods) > sum(isinstance(m, torch.nn.Conv2d) for m in mods)


def optimize(run: Run, progress: Progress | None = None) -> Summary:
    progress = progress or Progress()
    out, model = run.out, run.model
    (out / "data").mkdir(parents=True, exist_ok=True)
    eval_path = out / "data" / "eval.npz"
    run.eval_data.save(eval_path)
    data_hash = file_hash([eval_path])
    start = source_artifact(model)
    drop = min((t.max_accuracy_drop for t in run.targets), default=1.0)
    all_variants = catalogue(model, linear_heavy=_linear_heavy(model), accuracy_drop=drop, cpu=cpu_features())
    chosen = select(all_variants, run.settings.variants, run.settings.include_all)
    reference_name = "torch-eager" if model.is_torch else REFERENCE_ORT
    ref_variant = next(v for v in all_variants if v.name == reference_name)
    if ref_variant not in chosen:
        chosen.insert(0, ref_variant)  # the original must be measured: everything is verified against it
    chosen.sort(key=lambda v: v.name != reference_name)
    proto = run.protocol
    write_json_atomic(out / "config.json", RunConfig(
        model=str(model.path), model_kind=model.kind, source_hash=str(start.hash), spec=model.spec, targets=run.targets,
        variants=[v.name for v in chosen], protocol=proto.model_dump(),
        data={"eval": run.eval_data.source, "samples": len(run.eval_data), **run.eval_data.meta},
        left_out=[LeftOut(name=v.name, why=left_out_reason(v)) for v in all_variants if v not in chosen], note=run.settings.note))
    saved: dict[str, str | None] = {}
    for name, data in (("calib", run.calibration), ("tune", run.tuning)):  # for the build processes
        saved[name] = None
        if data is not None:
            data.save(out / "data" / f"{name}.npz")
            saved[name] = str(out / "data" / f"{name}.npz")
    ctx = BuildContext(source=model, calibration=run.calibration, tuning=run.tuning, log=progress.step,
                       calibration_path=saved["calib"], tuning_path=saved["tune"])
    results_path = out / "results.jsonl"
    done = {r["key"]: r for r in read_jsonl(results_path)}
    progress.start(len(chosen))
    records: list[Record] = []
    reference: Record | None = None
    for v in chosen:
        key = v.key(str(start.hash), proto.model_dump(), data_hash)
        if key in done:
            rec = parse_record(done[key], out)
            progress.note(f"{v.name}: cached ({rec.status})")
        else:
            progress.step(v.name)
            rec = _run_variant(v, key, run, start, eval_path, ctx, reference)
            append_jsonl(results_path, rec)
        records.append(rec)
        if v.name == reference_name:
            if rec.status != "ok":
                raise UserError(f"the original model could not be measured: {rec.error}", fix="check the model and data")
            reference = rec
        progress.advance()
    return finish(run, records, reference, eval_path, progress)


def _run_variant(v: Variant, key: str, run: Run, start, eval_path: Path, ctx: BuildContext, reference: Record | None) -> Record:
    base = Record(key=key, name=v.name, group=v.group, runtime=v.runtime, options=v.options, env=v.env,
                  chain=[ChainStep(pass_name=n, params=p) for n, p in v.chain], description=v.description,
                  needs_gpu=v.needs_gpu, batch_size=run.protocol.batch_size, status="skipped")
    ok, why = get_runtime(v.runtime).available()
    if v.needs_gpu and not gpu_present():
        ok, why = False, why or "no NVIDIA GPU on this machine"
    if not ok:
        return base.model_copy(update={"status": "skipped", "error": why})
    work = run.out / "work" / v.name
    t0 = time.perf_counter()
    artifact = cached_artifact(start, v.chain, run.out / "artifacts")
    if artifact is None:  # built in a process of its own: a crashing or noisy quantizer cannot take the sweep down
        ctx.log(f"building {v.name}")
        built = launch(BuildJob(start=start, chain=base.chain, cache=str(run.out / "artifacts"), source=run.model.ref(),
                                calibration=ctx.calibration_path, tuning=ctx.tuning_path, env=v.env), work / "build")
        if built.result is None:
            return base.model_copy(update={"status": "failed", "stage": "build", "error": f"build failed: {built.error}"})
        artifact = built.result
    build_s = time.perf_counter() - t0
    ref_outputs = run.out / "reference_outputs.npy"
    is_ref = reference is None
    s = run.settings
    gate = None if is_ref or not v.gate else Gate(
        reference_top1=reference.accuracy.top1 if reference and reference.accuracy else None, max_drop_points=s.verify_max_drop,
        min_agreement=s.verify_min_agreement, min_cosine=s.verify_min_cosine)
    job = MeasureJob(session=OpenSpec(name=v.name, artifact=artifact, runtime=v.runtime, options=v.options),
                     data=str(eval_path), family=run.model.spec.family_name, reference=None if is_ref else str(ref_outputs),
                     save_outputs=str(ref_outputs) if is_ref else None, protocol=run.protocol, gate=gate, env=v.env)
    measured = measure(job, run.model.spec, work)
    keep = {"key", "group", "chain", "description", "needs_gpu"}
    return measured.model_copy(update={**{k: getattr(base, k) for k in keep}, "build_s": round(build_s, 2),
                                       "stage": "measure" if measured.status != "ok" else None})


def run_interleave(run: Run, names: list[str], records: list[Record], eval_path: Path, isa: str | None = None) -> Interleaved | None:
    """Candidates and the ORT reference, side by side in one process (cached by the set measured). With ``isa``, every
    runtime that can be held to that instruction set is (its environment variables for the whole process), and each
    variant's figures say whether its runtime was."""
    by_name = {r.name: r for r in records if r.status == "ok"}
    if REFERENCE_ORT not in by_name:
        return None
    # One process runs them all: a runtime living in its own Python environment cannot join (its sweep figures stand).
    names = [n for n in names if n in by_name and n != REFERENCE_ORT and get_runtime(by_name[n].runtime).environment() is None]
    names.append(REFERENCE_ORT)
    caps = {n: get_runtime(by_name[n].runtime).isa_cap_env(isa) if isa else None for n in names}
    cache_key = json.dumps([sorted(str(by_name[n].key) for n in names), run.interleave_rounds,
                            run.interleave_protocol.model_dump(), isa])
    label = f"interleave-{isa}" if isa else "interleave"
    path = run.out / f"{label}.json"
    if path.exists():
        previous = Interleaved.model_validate({k: v for k, v in json.loads(path.read_text()).items() if k != "protocol"})
        if previous.cache_key == cache_key:
            return previous
    env: dict[str, str] = {}
    for n in names:  # torch variants want their allocator settings (the others do not mind them), and the ISA caps
        env.update(by_name[n].env)
        env.update(caps[n] or {})
    sessions = [OpenSpec(name=n, artifact=by_name[n].artifact, runtime=by_name[n].runtime, options=by_name[n].options)
                for n in names if by_name[n].artifact is not None]
    launched = launch(InterleaveJob(sessions=sessions, reference=REFERENCE_ORT, data=str(eval_path),
                                    protocol=run.interleave_protocol, rounds=run.interleave_rounds, env=env), run.out / "work" / label)
    if launched.result is None:
        raise UserError(f"interleaved re-measure failed: {launched.error}", fix=f"see work/{label}/job.log")
    variants = {n: v.model_copy(update={"isa_cap": isa if caps.get(n) else None}) for n, v in launched.result.variants.items()}
    result = launched.result.model_copy(update={"cache_key": cache_key, "variants": variants})
    write_json_atomic(path, result)
    return result


def run_capped(run: Run, records: list[Record], reference: Record | None, eval_path: Path, family: Family,
               progress: Progress) -> dict[str, Interleaved]:
    """For each CPU target that names a poorer instruction set than this machine's, its candidates re-measured with
    the runtimes held to that instruction set where they can be (oneDNN / ATen caps)."""
    capped: dict[str, Interleaved] = {}
    here = cpu_features().level
    for t in run.targets:
        if t.device != "cpu" or t.isa is None or t.isa in capped or isa_rank(here) <= isa_rank(t.isa):
            continue
        progress.step(f"re-measuring {t.name}'s candidates with the instruction set capped at {t.isa}")
        try:
            result = run_interleave(run, interleave_candidates([t], records, reference, family), records, eval_path, isa=t.isa)
        except UserError as e:
            progress.note(e.problem)
            continue
        if result is not None:
            capped[t.isa] = result
    return capped


def profile_variants(run: Run, names: list[str], records: list[Record], eval_path: Path, progress: Progress) -> None:
    """Op-level profiles of the recommended variants, each in its own process (a measurement, so not in the report
    step: ``servopt report`` only reads). Cached in ``profiles/``; a failed profile is stored with its reason."""
    by_name = {r.name: r for r in records}
    for name in dict.fromkeys(names):
        rec = by_name.get(name)
        if rec is None or rec.artifact is None or load_profile(run.out, name) is not None:
            continue
        progress.step(f"profiling {name}")
        launched = launch(ProfileJob(session=OpenSpec(name=name, artifact=rec.artifact, runtime=rec.runtime, options=rec.options),
                                     data=str(eval_path), env=rec.env), run.out / "work" / name / "profile")
        prof = launched.result or OpProfile(variant=name, profiler="none", total_ms_per_run=0.0, error=launched.error)
        write_json_atomic(run.out / "profiles" / f"{name}.json", prof)


def finish(run: Run, records: list[Record], reference: Record | None, eval_path: Path, progress: Progress) -> Summary:
    """Decide per target (after the interleaved re-measure), profile the picks, write summary.json and the reports."""
    family = run.family
    progress.step("re-measuring the top candidates side by side with the reference")
    names = interleave_candidates(run.targets, records, reference, family)
    interleaved = None
    if names:
        try:
            interleaved = run_interleave(run, names, records, eval_path)
        except UserError as e:
            progress.note(e.problem)
    capped = run_capped(run, records, reference, eval_path, family, progress)
    decisions = [decide(t, records, reference, family, capped.get(t.isa or "") or interleaved) for t in run.targets]
    summary = Summary(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), run_dir=str(run.out), reference=reference.name if reference else None,
        reference_ort=REFERENCE_ORT if any(r.name == REFERENCE_ORT for r in records) else None, targets=decisions,
        pareto_front=pareto_front(records, reference, family), interleaved=interleaved, capped=capped,
        counts={s: sum(r.status == s for r in records) for s in ("ok", "failed", "skipped")},
        environment=environment(libraries=all_libraries()))
    write_json_atomic(run.out / "summary.json", summary)
    profile_variants(run, [d.recommended or d.nearest for d in decisions if d.recommended or d.nearest], records, eval_path,
                     progress)
    from servopt.optimize.report import write_reports

    progress.step("writing the report")
    write_reports(run.out, summary, records)
    return summary
