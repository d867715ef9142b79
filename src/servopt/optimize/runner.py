"""``servopt optimize``: build every variant, verify it, benchmark it, decide per target, profile, report.

Every measurement (each variant, the side-by-side re-measure, each profile) is
a typed job run by ``bench.launcher`` in its own process; this module only
orchestrates and writes the run directory (its layout: ``optimize/rundir``).
A killed run leaves at most a temporary folder or a torn last line; both are
ignored, so running the same command again skips everything finished.

Jobs go through an executor (``optimize.executor``): on one machine each runs
here, one after another; on a Ray cluster (``--ray``) builds run in parallel,
and each variant is measured once per kind of node its targets name (their
``ray_resources``), on a node of that kind, alone there (``ray_executor``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
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
from servopt.machine import CpuFeatures, Device, cpu_features, environment, gpu_present, richer
from servopt.models.sources import LoadedModel
from servopt.optimize.decide import Decision, decide, interleave_candidates, pareto_front
from servopt.optimize.executor import LOST, Executor, LocalExecutor, Lost
from servopt.optimize.rundir import KindSummary, LeftOut, RunConfig, Summary, load_profile, profile_path
from servopt.optimize.targets import Target, kind_slug
from servopt.optimize.variants import Variant, catalogue, is_linear_heavy, left_out_reason, select
from servopt.passes.base import BuildContext, cached_artifact, file_hash, source_artifact
from servopt.passes.build_job import BuildJob
from servopt.results import append_jsonl, parse_record, read_jsonl, write_json_atomic
from servopt.runtimes.base import all_libraries, get_runtime
from servopt.settings import OptimizeSettings

REFERENCE_ORT = "ort-fp32"


def open_executor(ray_address: str | None) -> Executor:
    """The local executor, or a Ray cluster's (``auto``, ``local``, ``ray://host:10001``, ``host:6379``): Ray is imported
    only here, and only when asked for."""
    if not ray_address:
        return LocalExecutor()
    from servopt.optimize.ray_executor import RayExecutor

    return RayExecutor.connect(ray_address)


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


@dataclass
class Unit:
    """One measurement to make: a variant, for a kind of node (None: this machine, for every target)."""

    variant: Variant
    kind: str | None
    key: str


def unit_key(variant_key: str, kind: str | None) -> str:
    """A record's key: the variant's (what it is, on what data, under what protocol), and on a distributed sweep the
    kind of node it is measured for, so a resumed run keeps one record per variant and kind. One machine: unchanged."""
    if kind is None:
        return variant_key
    return hashlib.sha256(f"{variant_key}|{kind}".encode()).hexdigest()[:16]


def lost(record: dict) -> bool:
    """A record of a job the cluster lost (its worker or node died): a rerun measures it again, as after a kill here."""
    return record.get("status") == "failed" and str(record.get("error") or "").startswith(LOST)


def measurement_kinds(targets: list[Target], distributed: bool) -> dict[str | None, dict[str, float] | None]:
    """The kinds of node a sweep measures on, in the targets' order, with their Ray resources. One machine: one kind,
    None (this machine, for every target)."""
    if not distributed:
        return {None: None}
    kinds: dict[str | None, dict[str, float] | None] = {}
    for t in targets:
        kinds.setdefault(t.kind, dict(t.ray_resources) if t.ray_resources else None)
    return kinds


def kinds_of(v: Variant, targets: list[Target], kinds: dict[str | None, dict[str, float] | None], distributed: bool) -> list[str | None]:
    """The kinds a variant is measured for: each kind with a target it can serve (a GPU variant for GPU targets, the
    others for CPU and edge targets); a variant no target can use is still measured once, as one machine would."""
    if not distributed:
        return [None]
    mine = [k for k in kinds if any(t.kind == k and t.device.computes_on is (Device.GPU if v.needs_gpu else Device.CPU) for t in targets)]
    return mine or [next(iter(kinds))]


def _target_kind(t: Target, distributed: bool) -> str | None:
    return t.kind if distributed else None


def _folder(run: Run, name: str, kind: str | None) -> Path:
    """A variant's job folders: ``work/<variant>/`` (one machine), ``work/<variant>/<kind>/`` per kind of node."""
    return run.out / "work" / name if kind is None else run.out / "work" / name / kind_slug(kind)


def _reference_outputs(run: Run, kind: str | None) -> Path:
    return run.out / ("reference_outputs.npy" if kind is None else f"reference_outputs-{kind_slug(kind)}.npy")


def runtime_available(runtime: str, needs_gpu: bool) -> tuple[bool, str]:
    """Whether the machine this runs on can run the variant's runtime, and why not."""
    ok, why = get_runtime(runtime).available()
    if needs_gpu and not gpu_present():
        ok, why = False, why or "no NVIDIA GPU on this machine"
    return ok, why


def measure_variant(job: MeasureJob, spec, workdir: Path, needs_gpu: bool) -> Record:
    """A variant's measurement on the machine this runs on (a node of its kind, in a distributed sweep): skipped
    when its runtime cannot run here, else verified and timed, then its cold start (``bench.run.measure``)."""
    ok, why = runtime_available(job.session.runtime, needs_gpu)
    if not ok:
        return Record(name=job.session.name, runtime=job.session.runtime, status="skipped", error=why)
    return measure(job, spec, workdir)


def _base_record(v: Variant, key: str, run: Run, kind: str | None) -> Record:
    return Record(key=key, name=v.name, group=v.group, runtime=v.runtime, options=v.options, env=v.env,
                  chain=[ChainStep(pass_name=n, params=p) for n, p in v.chain], description=v.description,
                  needs_gpu=v.needs_gpu, batch_size=run.protocol.batch_size, status="skipped", measured_for=kind)


def _build_job(v: Variant, chain: list[tuple[str, dict]], run: Run, start, ctx: BuildContext) -> BuildJob:
    return BuildJob(start=start, chain=[ChainStep(pass_name=n, params=p) for n, p in chain], cache=str(run.out / "artifacts"),
                    source=run.model.ref(), calibration=ctx.calibration_path, tuning=ctx.tuning_path, env=v.env)


def _measure_job(v: Variant, artifact, run: Run, eval_path: Path, reference: Record | None, ref_outputs: Path) -> MeasureJob:
    """The measurement of a variant; the first of the run (``reference`` None) is the original's, whose outputs the
    others are verified against."""
    is_ref = reference is None
    s = run.settings
    gate = None if is_ref or not v.gate else Gate(
        reference_top1=reference.accuracy.top1 if reference and reference.accuracy else None, max_drop_points=s.verify_max_drop,
        min_agreement=s.verify_min_agreement, min_cosine=s.verify_min_cosine)
    return MeasureJob(session=OpenSpec(name=v.name, artifact=artifact, runtime=v.runtime, options=v.options),
                      data=str(eval_path), family=run.model.spec.family_name, reference=None if is_ref else str(ref_outputs),
                      save_outputs=str(ref_outputs) if is_ref else None, protocol=run.protocol, gate=gate, env=v.env)


def _merged(base: Record, measured: Record, build_s: float | None) -> Record:
    """The measurement's record with the variant's own fields (key, chain …) and its build time."""
    if measured.status == "skipped":
        return base.model_copy(update={"status": "skipped", "error": measured.error})
    keep = {"key", "group", "chain", "description", "needs_gpu", "measured_for"}
    return measured.model_copy(update={**{k: getattr(base, k) for k in keep},
                                       "build_s": round(build_s, 2) if build_s is not None else None,
                                       "stage": "measure" if measured.status != "ok" else None})


def optimize(run: Run, progress: Progress | None = None, executor: Executor | None = None) -> Summary:
    """The sweep. ``executor``: where its jobs run (default: here, one after another; ``open_executor``)."""
    progress = progress or Progress()
    executor = executor or LocalExecutor()
    distributed = executor.distributed
    out, model = run.out, run.model
    (out / "data").mkdir(parents=True, exist_ok=True)
    eval_path = out / "data" / "eval.npz"
    run.eval_data.save(eval_path)
    data_hash = file_hash([eval_path])
    start = source_artifact(model)
    drop = min((t.max_accuracy_drop for t in run.targets), default=1.0)
    all_variants = catalogue(model, linear_heavy=_linear_heavy(model), accuracy_drop=drop, cpu=cpu_features())
    chosen = select(all_variants, run.settings.variants, run.settings.include_all)
    reference_name = run_reference(run)
    ref_variant = next(v for v in all_variants if v.name == reference_name)
    if ref_variant not in chosen:
        chosen.insert(0, ref_variant)  # the original must be measured: everything is verified against it
    chosen.sort(key=lambda v: v.name != reference_name)
    proto = run.protocol
    kinds = measurement_kinds(run.targets, distributed)
    write_json_atomic(out / "config.json", RunConfig(
        model=str(model.path), model_kind=model.kind, source_hash=str(start.hash), spec=model.spec, targets=run.targets,
        variants=[v.name for v in chosen], protocol=proto.model_dump(),
        data={"eval": run.eval_data.source, "samples": len(run.eval_data), **run.eval_data.meta},
        left_out=[LeftOut(name=v.name, why=left_out_reason(v)) for v in all_variants if v not in chosen], note=run.settings.note,
        measured_for=list(kinds)))
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
    units = [Unit(v, k, unit_key(v.key(str(start.hash), proto.model_dump(), data_hash), k))
             for v in chosen for k in kinds_of(v, run.targets, kinds, distributed)]
    if distributed:
        executor.prepare(out, {k or "any node": r or {} for k, r in kinds.items()})
        records, references = _sweep_distributed(run, units, kinds, start, eval_path, ctx, done, executor, progress, reference_name)
    else:
        records, reference = _sweep_here(run, units, start, eval_path, ctx, done, executor, progress, reference_name)
        references = {None: reference}
    return finish(run, records, references, eval_path, progress, executor, kinds)


def _sweep_here(run: Run, units: list[Unit], start, eval_path: Path, ctx: BuildContext, done: dict, executor: Executor,
                progress: Progress, reference_name: str) -> tuple[list[Record], Record | None]:
    """One machine: each variant built, then measured, in turn, the reference first."""
    results_path = run.out / "results.jsonl"
    progress.start(len(units))
    records: list[Record] = []
    reference: Record | None = None
    for u in units:
        if u.key in done and not lost(done[u.key]):
            rec = parse_record(done[u.key], run.out)
            progress.note(f"{u.variant.name}: cached ({rec.status})")
        else:
            progress.step(u.variant.name)
            rec = _run_variant(u.variant, u.key, run, start, eval_path, ctx, reference, executor)
            append_jsonl(results_path, rec)
        records.append(rec)
        if u.variant.name == reference_name:
            if rec.status != "ok":
                raise UserError(f"the original model could not be measured: {rec.error}", fix="check the model and data")
            reference = rec
        progress.advance()
    return records, reference


def _run_variant(v: Variant, key: str, run: Run, start, eval_path: Path, ctx: BuildContext, reference: Record | None,
                 executor: Executor) -> Record:
    base = _base_record(v, key, run, None)
    ok, why = runtime_available(v.runtime, v.needs_gpu)
    if not ok:
        return base.model_copy(update={"status": "skipped", "error": why})
    work = run.out / "work" / v.name
    t0 = time.perf_counter()
    artifact = cached_artifact(start, v.chain, run.out / "artifacts")
    if artifact is None:  # built in a process of its own: a crashing or noisy quantizer cannot take the sweep down
        ctx.log(f"building {v.name}")
        built = executor.submit(launch, _build_job(v, v.chain, run, start, ctx), work / "build", what=f"build {v.name}").result()
        if built.result is None:
            return base.model_copy(update={"status": "failed", "stage": "build", "error": f"build failed: {built.error}"})
        artifact = built.result
    build_s = time.perf_counter() - t0
    job = _measure_job(v, artifact, run, eval_path, reference, _reference_outputs(run, None))
    measured = executor.submit(measure_variant, job, run.model.spec, work, v.needs_gpu, what=f"measure {v.name}").result()
    return _merged(base, measured, build_s)


def _build_all(run: Run, variants: list[Variant], start, ctx: BuildContext, executor: Executor,
               progress: Progress) -> dict[str, tuple[object, float | None, str | None]]:
    """Every chain the variants need, in parallel, the shared steps once and first: by depth, each distinct prefix one
    build job (a later job finds the steps before it cached). Per variant: (artifact or None, build seconds, error)."""
    cache = run.out / "artifacts"
    failed: dict[str, str] = {}  # a chain prefix (JSON) → why it could not be built
    wall: dict[str, float] = {}

    def ident(chain: list[tuple[str, dict]]) -> str:
        return json.dumps(chain, sort_keys=True, default=str)

    for depth in range(1, max((len(v.chain) for v in variants), default=0) + 1):
        owners: dict[str, tuple[Variant, list[tuple[str, dict]]]] = {}
        for v in sorted(variants, key=lambda v: len(v.chain)):  # a prefix's folder: the variant whose whole chain it is
            prefix = v.chain[:depth]
            if len(v.chain) < depth or any(ident(v.chain[:d]) in failed for d in range(1, depth)):
                continue
            if ident(prefix) not in owners and cached_artifact(start, prefix, cache) is None:
                owners[ident(prefix)] = (v, prefix)
        futures = {}
        for key, (v, prefix) in owners.items():
            folder = run.out / "work" / v.name / ("build" if len(v.chain) == depth else f"build-{depth}")
            what = f"build {v.name}" + ("" if len(v.chain) == depth else f" (step {depth})")
            progress.step(what)
            futures[key] = executor.submit(launch, _build_job(v, prefix, run, start, ctx), folder, what=what)
        for key, future in futures.items():
            try:
                built = future.result()
            except Lost as e:
                failed[key] = str(e)
                continue
            if built.result is None:
                failed[key] = f"build failed: {built.error}"
            else:
                wall[key] = built.wall_s
    out: dict[str, tuple[object, float | None, str | None]] = {}
    for v in variants:
        why = next((failed[ident(v.chain[:d])] for d in range(1, len(v.chain) + 1) if ident(v.chain[:d]) in failed), None)
        artifact = None if why else cached_artifact(start, v.chain, cache)
        if artifact is None and why is None:
            why = "build failed: its artifact is missing after the build"
        out[v.name] = (artifact, wall.get(ident(v.chain), 0.0), why)
    return out


def _sweep_distributed(run: Run, units: list[Unit], kinds: dict[str | None, dict[str, float] | None], start, eval_path: Path,
                       ctx: BuildContext, done: dict, executor: Executor, progress: Progress,
                       reference_name: str) -> tuple[list[Record], dict[str | None, Record]]:
    """A cluster: every build in parallel, then the original's measurement on each kind of node, then every other
    measurement in parallel, each on a node of its kind, alone there. Records are appended as they come in."""
    results_path = run.out / "results.jsonl"
    progress.start(len(units))
    records: dict[tuple[str, str | None], Record] = {}
    todo: list[Unit] = []
    for u in units:
        if u.key in done and not lost(done[u.key]):
            records[(u.variant.name, u.kind)] = parse_record(done[u.key], run.out)
            progress.note(f"{u.variant.name} for {u.kind or 'any node'}: cached ({records[(u.variant.name, u.kind)].status})")
            progress.advance()
        else:
            todo.append(u)
    built = _build_all(run, list({u.variant.name: u.variant for u in todo}.values()), start, ctx, executor, progress)

    def submit(u: Unit, reference: Record | None, ref_outputs: Path) -> Future | Record:
        base = _base_record(u.variant, u.key, run, u.kind)
        artifact, _, why = built[u.variant.name]
        if why is not None:
            return base.model_copy(update={"status": "failed", "stage": "build", "error": why})
        job = _measure_job(u.variant, artifact, run, eval_path, reference, ref_outputs)
        progress.step(f"measuring {u.variant.name} for {u.kind or 'any node'}")
        return executor.submit(measure_variant, job, run.model.spec, _folder(run, u.variant.name, u.kind), u.variant.needs_gpu,
                               resources=kinds[u.kind], what=f"measure {u.variant.name} for {u.kind or 'any node'}")

    def collect(u: Unit, outcome: Future | Record) -> Record:
        base = _base_record(u.variant, u.key, run, u.kind)
        if isinstance(outcome, Record):
            rec = outcome
        else:
            try:
                rec = _merged(base, outcome.result(), built[u.variant.name][1])
            except Lost as e:
                rec = base.model_copy(update={"status": "failed", "stage": "measure", "error": str(e)})
        append_jsonl(results_path, rec)
        records[(u.variant.name, u.kind)] = rec
        progress.advance()
        return rec

    # The original first, on every kind that measures it: the others are verified against its outputs there.
    first = [u for u in todo if u.variant.name == reference_name]
    for u, outcome in [(u, submit(u, None, _reference_outputs(run, u.kind))) for u in first]:
        collect(u, outcome)
    references = {k: rec for (name, k), rec in records.items() if name == reference_name}
    for k, rec in references.items():
        if rec.status != "ok":
            raise UserError(f"the original model could not be measured{f' for {k}' if k else ''}: {rec.error}",
                            fix="check the model and data" if not str(rec.error).startswith(LOST) else "check the cluster, then rerun")
    primary = next(k for k in kinds if k in references)  # a kind without the original (GPU-only) is verified against this one
    pending: dict[Future, Unit] = {}
    for u in todo:
        if u.variant.name == reference_name:
            continue
        ref_kind = u.kind if u.kind in references else primary
        outcome = submit(u, references[ref_kind], _reference_outputs(run, ref_kind))
        if isinstance(outcome, Record):
            collect(u, outcome)
        else:
            pending[outcome] = u
    for future in as_completed(pending):
        collect(pending[future], future)
    return [records[(u.variant.name, u.kind)] for u in units], references


def _label(kind: str | None, isa: str | None) -> str:
    return "-".join(["interleave", *([kind_slug(kind)] if kind else []), *([isa] if isa else [])])


def run_interleave(run: Run, names: list[str], records: list[Record], eval_path: Path, isa: str | None = None,
                   executor: Executor | None = None, kind: str | None = None,
                   resources: dict[str, float] | None = None) -> Interleaved | None:
    """Candidates and the ORT reference, side by side in one process (cached by the set measured). With ``isa``, every
    runtime that can be held to that instruction set is (its environment variables for the whole process), and each
    variant's figures say whether its runtime was. ``kind``: on a node of that kind (its records)."""
    executor = executor or LocalExecutor()
    by_name = {r.name: r for r in records if r.status == "ok"}
    if REFERENCE_ORT not in by_name:
        return None
    # One process runs them all: a runtime living in its own Python environment cannot join (its sweep figures stand).
    names = [n for n in names if n in by_name and n != REFERENCE_ORT and get_runtime(by_name[n].runtime).environment() is None]
    names.append(REFERENCE_ORT)
    caps = {n: get_runtime(by_name[n].runtime).isa_cap_env(isa) if isa else None for n in names}
    cache_key = json.dumps([sorted(str(by_name[n].key) for n in names), run.interleave_rounds,
                            run.interleave_protocol.model_dump(), isa])
    label = _label(kind, isa)
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
    job = InterleaveJob(sessions=sessions, reference=REFERENCE_ORT, data=str(eval_path), protocol=run.interleave_protocol,
                        rounds=run.interleave_rounds, env=env)
    try:
        launched = executor.submit(launch, job, run.out / "work" / label, resources=resources, what=label).result()
    except Lost as e:
        raise UserError(f"interleaved re-measure {label}: {e}", fix="check the cluster, then rerun") from e
    if launched.result is None:
        raise UserError(f"interleaved re-measure failed: {launched.error}", fix=f"see work/{label}/job.log")
    variants = {n: v.model_copy(update={"isa_cap": isa if caps.get(n) else None}) for n, v in launched.result.variants.items()}
    result = launched.result.model_copy(update={"cache_key": cache_key, "variants": variants})
    write_json_atomic(path, result)
    return result


def run_capped(run: Run, records: list[Record], reference: Record | None, eval_path: Path, family: Family,
               progress: Progress, executor: Executor | None = None, kind: str | None = None,
               resources: dict[str, float] | None = None, targets: list[Target] | None = None) -> dict[str, Interleaved]:
    """For each CPU target that names a poorer instruction set than the measuring machine's, its candidates
    re-measured with the runtimes held to that instruction set where they can be (oneDNN / ATen caps)."""
    executor = executor or LocalExecutor()
    capped: dict[str, Interleaved] = {}
    env = next((r.environment for r in records if r.status == "ok" and r.environment), None)
    # The measuring machine: this one, or on a cluster the nodes of this kind (their records say which CPU).
    here = CpuFeatures(frozenset(env.cpu_flags)).level if executor.distributed and env else cpu_features().level
    for t in run.targets if targets is None else targets:
        if t.device is not Device.CPU or t.isa is None or t.isa in capped or not richer(here, t.isa):
            continue
        progress.step(f"re-measuring {t.name}'s candidates with the instruction set capped at {t.isa}")
        try:
            result = run_interleave(run, interleave_candidates([t], records, reference, family), records, eval_path, isa=t.isa,
                                    executor=executor, kind=kind, resources=resources)
        except UserError as e:
            progress.note(e.problem)
            continue
        if result is not None:
            capped[t.isa] = result
    return capped


def profile_variants(run: Run, names: list[str], records: list[Record], eval_path: Path, progress: Progress,
                     executor: Executor | None = None, kind: str | None = None, resources: dict[str, float] | None = None) -> None:
    """Op-level profiles of the recommended variants, each in its own process (a measurement, so not in the report
    step: ``servopt report`` only reads). Cached in ``profiles/`` (``profiles/<kind>/`` per kind of node); a failed
    profile is stored with its reason."""
    executor = executor or LocalExecutor()
    by_name = {r.name: r for r in records}
    for name in dict.fromkeys(names):
        rec = by_name.get(name)
        if rec is None or rec.artifact is None or load_profile(run.out, name, kind) is not None:
            continue
        progress.step(f"profiling {name}" + (f" for {kind}" if kind else ""))
        job = ProfileJob(session=OpenSpec(name=name, artifact=rec.artifact, runtime=rec.runtime, options=rec.options),
                         data=str(eval_path), env=rec.env)
        try:
            launched = executor.submit(launch, job, _folder(run, name, kind) / "profile", resources=resources,
                                       what=f"profile {name}").result()
            prof = launched.result or OpProfile(variant=name, profiler="none", total_ms_per_run=0.0, error=launched.error)
        except Lost as e:
            prof = OpProfile(variant=name, profiler="none", total_ms_per_run=0.0, error=str(e))
        write_json_atomic(profile_path(run.out, name, kind), prof)


@dataclass
class KindOutcome:
    """What ``finish`` makes of one kind of node's records: its re-measures and its targets' decisions."""

    decisions: dict[str, Decision]
    interleaved: Interleaved | None
    capped: dict[str, Interleaved]
    pareto_front: list[str]


def _finish_kind(run: Run, kind: str | None, resources: dict[str, float] | None, records: list[Record], targets: list[Target],
                 reference: Record | None, eval_path: Path, progress: Progress, executor: Executor) -> KindOutcome:
    """One kind of node (one machine: the only one): the side-by-side re-measure of its targets' top candidates, the
    capped re-measures, and its targets' decisions, on its own records only."""
    family = run.family
    progress.step(f"re-measuring the top candidates side by side with the reference{f' for {kind}' if kind else ''}")
    names = interleave_candidates(targets, records, reference, family)
    interleaved = None
    if names:
        try:
            interleaved = run_interleave(run, names, records, eval_path, executor=executor, kind=kind, resources=resources)
        except UserError as e:
            progress.note(e.problem)
    capped = run_capped(run, records, reference, eval_path, family, progress, executor, kind, resources, targets)
    decisions = {t.name: decide(t, records, reference, family, capped.get(t.isa or "") or interleaved) for t in targets}
    return KindOutcome(decisions, interleaved, capped, pareto_front(records, reference, family))


def _per_kind(executor: Executor, kinds: list, work: Callable) -> list:
    """``work`` for each kind: one after another here, all kinds at once on a cluster (each on its own nodes)."""
    if not executor.distributed or len(kinds) < 2:
        return [work(k) for k in kinds]
    with ThreadPoolExecutor(len(kinds)) as pool:
        return list(pool.map(work, kinds))


def finish(run: Run, records: list[Record], references: dict[str | None, Record | None], eval_path: Path, progress: Progress,
           executor: Executor | None = None, kinds: dict[str | None, dict[str, float] | None] | None = None) -> Summary:
    """Decide per target (after the interleaved re-measure), profile the picks, write summary.json and the reports.
    Per kind of node: its records, its original, its re-measures, on a node of its kind."""
    executor = executor or LocalExecutor()
    kinds = kinds or {None: None}
    primary = next((k for k in kinds if references.get(k) is not None), None)
    of_kind = {k: [r for r in records if r.measured_for == k] for k in kinds}
    targets = {k: [t for t in run.targets if _target_kind(t, executor.distributed) == k] for k in kinds}
    outcomes = dict(zip(kinds, _per_kind(executor, list(kinds), lambda k: _finish_kind(
        run, k, kinds[k], of_kind[k], targets[k], references.get(k) or references.get(primary), eval_path, progress, executor)),
        strict=True))
    decisions = {name: d for o in outcomes.values() for name, d in o.decisions.items()}
    here = outcomes.get(None)  # one machine, or the targets of a distributed sweep that name no resources
    by_kind = [KindSummary(kind=k, ray_resources=kinds[k] or {}, targets=[t.name for t in targets[k]],
                           nodes=sorted({r.environment.node for r in of_kind[k] if r.environment and r.environment.node}),
                           interleaved=o.interleaved, capped=o.capped, pareto_front=o.pareto_front,
                           environment=next((r.environment for r in sorted(of_kind[k], key=lambda r: r.name != run_reference(run))
                                             if r.environment), None))
               for k, o in outcomes.items() if k is not None]
    reference = references.get(primary)
    summary = Summary(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), run_dir=str(run.out), reference=reference.name if reference else None,
        reference_ort=REFERENCE_ORT if any(r.name == REFERENCE_ORT for r in records) else None,
        targets=[decisions[t.name] for t in run.targets], pareto_front=here.pareto_front if here else [],
        interleaved=here.interleaved if here else None, capped=here.capped if here else {},
        counts={s: sum(r.status == s for r in records) for s in ("ok", "failed", "skipped")},
        environment=environment(libraries=all_libraries()), kinds=by_kind)
    write_json_atomic(run.out / "summary.json", summary)

    def profile(kind: str | None) -> None:
        picks = [d.recommended or d.nearest for d in (decisions[t.name] for t in targets[kind])]
        profile_variants(run, [p for p in picks if p], of_kind[kind], eval_path, progress, executor, kind, kinds[kind])

    _per_kind(executor, list(kinds), profile)
    from servopt.optimize.report import write_reports

    progress.step("writing the report")
    write_reports(run.out, summary, records)
    return summary


def run_reference(run: Run) -> str:
    """The variant every other is verified against: the original as it was given."""
    return "torch-eager" if run.model.is_torch else REFERENCE_ORT
