"""``servopt optimize``: the one sweep — build, verify and screen every variant, race, decide per target, report.

One algorithm for one machine and for a Ray cluster: every unit of work (a build, a measurement, a cold start, a
re-measure, a profile) goes to an executor as a function and its arguments and comes back as a future. The local
executor resolves them here (measurements one at a time, builds two at a time while nothing is timed); the Ray
executor runs them as tasks, a measurement alone on a node of the kind its targets name.

The stages, in order (``Sweep.run``):
1. the original model, measured first on every kind of node: everything is verified against its outputs;
2. rounds of (build a few variants, in parallel, nothing timed) then (screen them: verify, then a short timed
   measurement, one at a time), the variants ordered by the value the CPU's features and earlier runs of the same
   family predict (``optimize.racing.expected_value``), until the catalogue or the time budget (``--budget``) runs out;
3. variants that only recover quality another one lost (``Variant.refines``) are built only when that one misses a
   target's quality bounds, one by one, cheapest first, until one recovers it with the same kernels;
4. the race: a variant that another beats beyond the measurement noise on everything every target asks for is
   screened out (recorded, with what beat it); the contenders get their cold start and the side-by-side re-measure;
5. per kind of node: the interleaved and instruction-set-capped re-measures, the decisions, profiles, the reports.
``--full`` turns the race off (every variant built, measured and cold-started): the same decisions, slower.

A killed run leaves at most a temporary build folder or a torn last line; both are ignored, so running the same
command again skips everything finished (``RunDir`` says where everything is).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from servopt.bench.alternate import AlternationFailed, alternate, ratios
from servopt.bench.jobs import ColdStartJob, DuelJob, InterleaveJob, MeasureJob, OpenSpec, ProfileJob
from servopt.bench.launcher import Interrupted, OutOfTime, launch, stopping
from servopt.bench.protocol import Protocol
from servopt.bench.run import measure
from servopt.bench.scaling import ScalingJob
from servopt.contracts import Capacity, ChainStep, ColdStart, Gate, Interleaved, OpProfile, Record, Scaling, SideBySide
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.families.base import Family, family_of
from servopt.machine import CpuFeatures, Device, Isa, cpu_features, environment, gpu_present, richer
from servopt.models.sources import LoadedModel
from servopt.optimize import noise, pricing, racing
from servopt.optimize.decide import Decision, decide, interleave_candidates, pareto_front, unsettled
from servopt.optimize.executor import LOST, Executor, LocalExecutor, Lost
from servopt.optimize.rundir import KindSummary, LeftOut, RunConfig, RunDir, Summary, load_profile
from servopt.optimize.targets import Target
from servopt.optimize.variants import (
    Variant,
    baseline_of,
    catalogue,
    device_of,
    is_linear_heavy,
    machine_signature,
    measured_with,
    original_of,
    select,
    variant_key,
)
from servopt.passes.base import (
    BuildContext,
    build_data_key,
    cached_artifact,
    chain_data_key,
    dataset_digest,
    get_pass,
    source_artifact,
)
from servopt.passes.build_job import BuildJob
from servopt.results import append_jsonl, parse_record, write_json_atomic
from servopt.runtimes.base import all_libraries, get_runtime
from servopt.settings import OptimizeSettings

BUILD_ROUND = 4  # variants built together (two at a time here) before they are screened one by one


def sweep_protocol(racing: bool = True) -> Protocol:
    """Short phases, so that a sweep of 25 variants fits in minutes; the contenders are re-measured side by side with
    longer phases before deciding. A race screens with shorter ones still: a variant far behind shows it in half a
    second, and one within the noise stays a contender."""
    if racing:
        return Protocol(min_runs=30, min_seconds=0.5, batch_min_runs=5, batch_min_seconds=0.5, warmup=5, cold_start=False)
    return Protocol(min_runs=50, min_seconds=1.0, batch_min_runs=8, batch_min_seconds=1.0, warmup=10, cold_start=False)


def interleave_protocol() -> Protocol:
    return Protocol(min_runs=50, min_seconds=1.5, batch_min_runs=8, batch_min_seconds=1.5)


def open_executor(ray_address: str | None) -> Executor:
    """The local executor, or a Ray cluster's (``auto``, ``local``, ``ray://host:10001``, ``host:6379``): Ray is imported
    only here, and only when asked for."""
    if not ray_address:
        return LocalExecutor()
    from servopt.optimize.ray_executor import RayExecutor

    return RayExecutor.connect(ray_address)


@dataclass
class Progress:
    """Callbacks the CLI turns into rich progress bars; silent by default."""

    start: Callable[[int], None] = lambda total: None
    step: Callable[[str], None] = lambda message: None
    advance: Callable[[], None] = lambda: None
    note: Callable[[str], None] = lambda message: None
    result: Callable[[Record], None] = lambda record: None  # a variant's record, as it is written


@dataclass
class Unit:
    """One measurement to make: a variant, for a kind of node (None: this machine, for every target)."""

    variant: Variant
    kind: str | None
    key: str


def measured_on(v: Variant, kind: str | None) -> str:
    """What a unit's figures depend on besides the variant, its data and protocol (part of its key): the machine
    measuring it — this one (``machine_signature``), or on a cluster its kind of node — and the versions of its
    runtime's libraries (``measured_with``). A rerun into the same ``--out`` on another host, or after an ONNX Runtime
    upgrade, measures again; the re-measures keyed by the records' keys follow."""
    return json.dumps([machine_signature() if kind is None else f"kind {kind}", measured_with(v.runtime)], sort_keys=True)


def unit_key(variant_key: str, kind: str | None) -> str:
    """A record's key: the variant's (what it is, on what data, under what protocol), and on a distributed sweep the
    kind of node it is measured for, so a resumed run keeps one record per variant and kind. One machine: unchanged."""
    if kind is None:
        return variant_key
    return hashlib.sha256(f"{variant_key}|{kind}".encode()).hexdigest()[:16]


def _joining(names: list[str], by_name: dict[str, Record], leave_out: str | None = None) -> list[str]:
    """The variants of ``names`` that can join one interleaved process: measured, and not on a runtime living in a
    Python environment of its own (those keep their sweep figures, or take turns with the baseline)."""
    return [n for n in names if n in by_name and n != leave_out and get_runtime(by_name[n].runtime).environment() is None]


def _one_process(names: list[str], by_name: dict[str, Record], caps: dict[str, dict[str, str] | None] | None = None
                 ) -> tuple[list[OpenSpec], dict[str, str]]:
    """The sessions of ``names`` (their records in ``by_name``) for one process, and that process's environment."""
    env: dict[str, str] = {}
    for n in names:  # torch variants want their allocator settings (the others do not mind them), and the ISA caps
        env.update(by_name[n].env)
        env.update((caps or {}).get(n) or {})
    sessions = [OpenSpec(name=n, artifact=by_name[n].artifact, runtime=by_name[n].runtime, options=by_name[n].options)
                for n in names if by_name[n].artifact is not None]
    return sessions, env


def interleave_job(names: list[str], by_name: dict[str, Record], reference: str, data: Path, protocol: Protocol, rounds: int,
                   caps: dict[str, dict[str, str] | None] | None = None) -> InterleaveJob:
    """``names`` (their records in ``by_name``) alternated in one process against ``reference``, on ``data``."""
    sessions, env = _one_process(names, by_name, caps)
    return InterleaveJob(sessions=sessions, reference=reference, data=str(data), protocol=protocol, rounds=rounds, env=env)


def as_served(spec: OpenSpec) -> OpenSpec:
    """A variant as a server opens it (``Runtime.serving_options``: ONNX Runtime's idle threads sleep instead of
    spinning)."""
    rt = get_runtime(spec.runtime)
    served = rt.serving_options(rt.parse_options(spec.options))
    return spec.model_copy(update={"options": served.model_dump(mode="json", exclude_defaults=True)})


def duel_job(names: list[str], by_name: dict[str, Record], data: Path, figures: list[str], seconds: float,
             batch_size: int = 32, min_pairs: int = 8) -> DuelJob:
    """``names`` taking turns block by block in one process on ``figures`` (``bench.duel``), a lead counting from
    ``noise.TIE_GAP``; each opened as a server opens it (``as_served``: ONNX Runtime's threads not spinning), since
    the close call is about how it will run served."""
    sessions, env = _one_process(names, by_name)
    sessions = [as_served(s) for s in sessions]
    return DuelJob(sessions=sessions, data=str(data), batch_size=batch_size, figures=figures, seconds=seconds,
                   tie_gap=noise.TIE_GAP, min_pairs=min_pairs, env=env)


def _stored_interleaved(path: Path) -> Interleaved | None:
    """An interleaved re-measure stored by this run (or an older servopt's, whose files also held its protocol)."""
    if not path.exists():
        return None
    return Interleaved.model_validate({k: v for k, v in json.loads(path.read_text()).items() if k != "protocol"})


def lost(record: dict) -> bool:
    """A record of a job the cluster lost (its worker or node died): a rerun measures it again, as after a kill here."""
    return record.get("status") == "failed" and str(record.get("error") or "").startswith(LOST)


def runtime_available(runtime: str) -> tuple[bool, str]:
    """Whether the machine this runs on can run the runtime, and why not."""
    ok, why = get_runtime(runtime).available()
    if get_runtime(runtime).device is Device.GPU and not gpu_present():
        ok, why = False, why or "no NVIDIA GPU on this machine"
    return ok, why


def measure_variant(job: MeasureJob, spec, workdir: Path, deadline: float | None = None) -> Record:
    """A variant's measurement on the machine this runs on (a node of its kind, in a distributed sweep): skipped
    when its runtime cannot run here, else verified and timed (``bench.run.measure``), stopped at ``deadline``."""
    ok, why = runtime_available(job.session.runtime)
    if not ok:
        return Record(name=job.session.name, runtime=job.session.runtime, status="skipped", error=why)
    return measure(job, spec, workdir, deadline)


def cold_start(job: ColdStartJob, workdir: Path, deadline: float | None = None) -> ColdStart:
    """Imports + load + first answer, timed from outside the job's process, with its peak memory."""
    try:
        started = launch(job, workdir, None, deadline)
    except OutOfTime as e:
        return ColdStart(error=f"not measured: {e}")
    return started.result.model_copy(update={"total_s": started.ready_s}) if started.result is not None else ColdStart(error=started.error)


def _linear_heavy(model: LoadedModel) -> bool:
    if model.kind == "onnx":
        return is_linear_heavy(str(model.path))
    import torch

    mods = list(model.torch_module().modules())
    return sum(isinstance(m, torch.nn.Linear) for m in mods) > sum(isinstance(m, torch.nn.Conv2d) for m in mods)


def _ident(chain: list[tuple[str, dict]]) -> str:
    return json.dumps(chain, sort_keys=True, default=str)


@dataclass
class KindOutcome:
    """What the finish makes of one kind of node's records: its re-measures and its targets' decisions."""

    decisions: dict[str, Decision]
    interleaved: Interleaved | None
    capped: dict[str, Interleaved]
    pareto_front: list[str]
    scaling: Scaling | None = None


@dataclass
class Sweep:
    """One run of ``servopt optimize``: the model, its data, the settings and targets, where jobs run, and the run
    directory. ``run()`` is the whole algorithm."""

    model: LoadedModel
    eval_data: Dataset
    calibration: Dataset | None
    tuning: Dataset | None
    settings: OptimizeSettings
    targets: list[Target]
    executor: Executor = field(default_factory=LocalExecutor)
    progress: Progress = field(default_factory=Progress)
    # ``(run_dir, variant, percentile, limit_ms, start_rps, cores, budget_s, quick) -> Capacity``: a priced target's
    # pick served and its capacity within the SLO searched (``serve.capacity.probe``, which the commands layer passes:
    # this layer cannot start a server); None: prices come from the offline figures
    capacity_probe: Callable[..., Capacity] | None = None
    # filled in by run()
    records: dict[tuple[str, str | None], Record] = field(default_factory=dict)
    references: dict[str | None, Record] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    not_tried: list[LeftOut] = field(default_factory=list)
    beaten: dict[str | None, set[str]] = field(default_factory=dict)  # per kind: beaten beyond noise (no contenders)
    spent: dict[str, float] = field(default_factory=dict)  # wall seconds each variant took to build and screen here
    reused: list[str] = field(default_factory=list)  # figures an earlier run into this --out took (``Summary.reused``)
    late: dict[str, str] = field(default_factory=dict)  # variants whose build the time budget's end stopped, and why
    started: float = field(default_factory=time.monotonic)

    # ------------------------------------------------------------------------------------------------ context
    def __post_init__(self) -> None:
        self.dir = RunDir(self.settings.out)
        self.family: Family = family_of(self.model.spec)
        self.distributed = self.executor.distributed
        drop = min((t.max_accuracy_drop for t in self.targets), default=1.0)
        # a CPU target naming an ISA without 8-bit dot products (cpu-server: AVX2) gets dynamic INT8 weights it computes
        # right (7 bits), even where this machine has VNNI (decide also fails a model that would overflow there)
        poorer = any(t.device is Device.CPU and t.isa is not None and t.isa < Isa.AVX512_VNNI for t in self.targets)
        self.all_variants = catalogue(self.model, linear_heavy=_linear_heavy(self.model), accuracy_drop=drop, cpu=cpu_features(),
                                      deploy_without_vnni=poorer)
        self.original = original_of(self.all_variants)
        self.baseline = baseline_of(self.all_variants)
        chosen = select(self.all_variants, self.settings.variants, self.settings.include_all)
        if self.settings.lab:
            chosen += [v for v in self.all_variants if v.group == "lab" and v.default is False and v not in chosen
                       and "autotun" not in v.left_out_why]
        # The original must be measured (everything is verified against it), and the baseline (ratios are taken to it).
        for must in (self.baseline, self.original):
            if must not in chosen:
                chosen.insert(0, must)
        self.chosen = sorted(chosen, key=lambda v: (not v.is_original, not v.is_baseline))
        self.kinds = self._measurement_kinds()

    @property
    def out(self) -> Path:
        return self.dir.root

    @property
    def racing(self) -> bool:
        return not self.settings.full

    @property
    def protocol(self) -> Protocol:
        """The sweep's protocol, with the family's own axes (a text encoder's batch × length grid, real texts batched
        in arrival order and sorted by length)."""
        base = Protocol.quick().model_copy(update={"cold_start": False}) if self.settings.quick else sweep_protocol(self.racing)
        if self.racing:  # screening leaves the family's axes (a text encoder's grid: most of its time) to the picks
            return base
        return base.model_copy(update=self.axes)

    @property
    def axes(self) -> dict:
        """The family's own axes of a measurement: a text encoder's batch × length grid, its real texts batched in
        arrival order and sorted by length (decisions do not use them: they are what a report shows of a variant)."""
        grid = list(self.family.sweep_grid[:2] if self.settings.quick else self.family.sweep_grid)
        return {"grid": grid, "length_batching": self.eval_data.lengths is not None}

    @property
    def interleave_protocol(self) -> Protocol:
        return Protocol.quick() if self.settings.quick else interleave_protocol()

    @property
    def interleave_rounds(self) -> int:
        return 2 if self.settings.quick else self.settings.interleave_rounds

    def _measurement_kinds(self) -> dict[str | None, dict[str, float] | None]:
        """The kinds of node the sweep measures on, in the targets' order, with their Ray resources. One machine: one
        kind, None (this machine, for every target)."""
        if not self.distributed:
            return {None: None}
        kinds: dict[str | None, dict[str, float] | None] = {}
        for t in self.targets:
            kinds.setdefault(t.kind, dict(t.ray_resources) if t.ray_resources else None)
        return kinds

    def kinds_of(self, v: Variant) -> list[str | None]:
        """The kinds a variant is measured for: each kind with a target it can serve (a GPU variant for GPU targets, the
        others for CPU and edge targets); a variant no target can use is still measured once, as one machine would."""
        if not self.distributed:
            return [None]
        mine = [k for k in self.kinds if any(t.kind == k and t.device.computes_on is device_of(v) for t in self.targets)]
        return mine or [next(iter(self.kinds))]

    def targets_of(self, kind: str | None) -> list[Target]:
        return [t for t in self.targets if (t.kind if self.distributed else None) == kind]

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # ------------------------------------------------------------------------------------------------ the run
    def run(self) -> Summary:
        """The whole sweep. Stopped by SIGINT/SIGTERM (``launcher.stop_all``, the jobs under way killed): the best
        answer from what was measured, marked interrupted (``_finish``); the same command resumes."""
        self._prepare()
        self.progress.start(len(self.units))  # before a resumed run's cached records advance it
        try:
            self._stages()
            return self._finish()
        except (Interrupted, Exception):  # once stopping, a failure is the stop's doing (a killed server's search)
            if not stopping():
                raise
        if not self.references:
            raise UserError("interrupted before the original model was measured: nothing to decide on",
                            fix="rerun the same command (what was finished is kept)")
        return self._finish(interrupted=True)

    def _stages(self) -> None:
        todo = self._todo()
        self._measure_originals(todo)
        first = [u for u in todo if not u.variant.is_original and not (self.racing and u.variant.refines)]
        if self.racing:  # the likely winners, their quality recovered, then the rest (what a budget drops first)
            likely, rest = racing.likely_first(first, self.family.name, cpu_features())
            self._screen(likely)
            self._refine([u for u in todo if u.variant.refines and not u.variant.is_original])
            self._screen(rest)
        else:
            self._screen(racing.order(first, self.family.name, cpu_features()))
        self._race_and_cold_start()

    def _prepare(self) -> None:
        self.dir.data.mkdir(parents=True, exist_ok=True)
        self.eval_data.save(self.dir.eval_data)
        data_hash = dataset_digest(self.dir.eval_data)
        saved: dict[str, str | None] = {}
        for name, data in (("calib", self.calibration), ("tune", self.tuning)):  # for the build processes
            saved[name] = None
            if data is not None:
                data.save(self.dir.saved_data(name))
                saved[name] = str(self.dir.saved_data(name))
        self.start = source_artifact(self.model, build_data_key(saved["calib"], saved["tune"]))
        proto = self.protocol.model_dump()
        self.units = [Unit(v, k, unit_key(variant_key(v, str(self.start.hash), proto, data_hash, chain_data_key(self.start, v.chain),
                                                  measured_on(v, k)), k))
                      for v in self.chosen for k in self.kinds_of(v)]
        write_json_atomic(self.dir.config, RunConfig(
            model=str(self.model.path), model_kind=self.model.kind, source_hash=str(self.start.hash), spec=self.model.spec,
            targets=self.targets, variants=[v.name for v in self.chosen], protocol=proto,
            data={"eval": self.eval_data.source, "samples": len(self.eval_data), **self.eval_data.meta},
            left_out=[LeftOut(name=v.name, why=v.left_out) for v in self.all_variants if v not in self.chosen],
            note=self.settings.note, measured_for=list(self.kinds)))
        self.ctx = BuildContext(source=self.model, calibration=self.calibration, tuning=self.tuning, log=self.progress.step,
                                calibration_path=saved["calib"], tuning_path=saved["tune"])
        if self.distributed:
            self.executor.prepare(self.out, {k or "any node": r or {} for k, r in self.kinds.items()})

    def _todo(self) -> list[Unit]:
        """The units a rerun has not finished (a lost job counts as not finished); the finished ones' records loaded."""
        done = {r["key"]: r for r in self.dir.read_results()}
        todo = []
        for u in self.units:
            if u.key in done and not lost(done[u.key]):
                rec = parse_record(done[u.key], self.out)
                self.records[(u.variant.name, u.kind)] = rec
                self.reused.append(f"{u.variant.name}{self._for(u.kind)}")
                self.progress.note(f"{u.variant.name}{self._for(u.kind)}: cached ({rec.status})")
                self.progress.advance()
            else:
                todo.append(u)
        for k in self.kinds:
            rec = self.records.get((self.original.name, k))
            if rec is not None:
                self.references[k] = rec
        return todo

    @staticmethod
    def _for(kind: str | None) -> str:
        return f" for {kind}" if kind else ""

    def _base_record(self, u: Unit) -> Record:
        v = u.variant
        return Record(key=u.key, name=v.name, group=v.group, runtime=v.runtime, options=v.options, env=v.env,
                      chain=[ChainStep(pass_name=n, params=p) for n, p in v.chain], description=v.description, refines=v.refines,
                      catalogue_index=next((i for i, c in enumerate(self.all_variants) if c.name == v.name), None),
                      needs_gpu=device_of(v) is Device.GPU, batch_size=self.protocol.batch_size, status="skipped",
                      measured_for=u.kind)

    def _record(self, u: Unit, rec: Record) -> Record:
        append_jsonl(self.dir.results, rec)
        self.records[(u.variant.name, u.kind)] = rec
        self.progress.advance()
        self.progress.result(rec)
        return rec

    def deadline(self, v: Variant) -> float | None:
        """When a job of ``v`` must end (``time.time()``): the time budget's end, less the finish's profiles and report;
        None without a budget, and for the original and the baseline (measured whatever the budget)."""
        budget = self.settings.budget_seconds
        if budget is None or v.is_original or v.is_baseline:
            return None
        return time.time() - self.elapsed() + budget - racing.closing_seconds(len(self.targets))

    def finish_deadline(self, closing: bool = True) -> float | None:
        """When a job of the sweep's finish (a re-measure, a duel, the scaling, a cold start, a pick's axes) must end:
        the budget's end less the profiles and the report (``closing``), or the budget's end itself (a profile). Their
        time is planned (``racing.finish_estimate``), but a model's call time can outgrow any plan (MPNet's side-by-side
        re-measure took 2 min of a 10-minute budget): the deadline is what makes the budget bind. None without one."""
        budget = self.settings.budget_seconds
        if budget is None:
            return None
        return time.time() - self.elapsed() + budget - (racing.closing_seconds(len(self.targets)) if closing else 0.0)

    def _out_of_time(self, what: str, e: Exception) -> None:
        self.problems.append(f"{what}: stopped at the time budget's end (--budget {self.settings.budget}; {e}); rerun with a "
                             "larger --budget to finish it (finished work is kept)")

    def _not_finished(self, u: Unit, why: str) -> None:
        """A job the time budget's end stopped: listed as not tried, no record (a rerun with more time tries it)."""
        self.not_tried.append(LeftOut(name=u.variant.name, why=f"not finished: {why} (--budget {self.settings.budget}): rerun "
                                      "with a larger --budget (finished variants are kept)"))
        self.progress.note(f"{u.variant.name}{self._for(u.kind)}: not finished, {why}")

    # ------------------------------------------------------------------------------------------------ builds
    def _build(self, variants: list[Variant]) -> dict[str, tuple[object, float | None, str | None]]:
        """Every chain the variants need, the shared steps once and first: by depth, each distinct prefix one build
        job (a later job finds the steps before it cached), in parallel except passes that time themselves, which build
        alone. Nothing is timed meanwhile. Per variant: (artifact or None, build seconds, error)."""
        cache = self.dir.artifacts
        failed: dict[str, str] = {}  # a chain prefix (JSON) → why it could not be built
        late: set[str] = set()  # the prefixes of ``failed`` that the time budget's end stopped
        wall: dict[str, float] = {}
        for depth in range(1, max((len(v.chain) for v in variants), default=0) + 1):
            owners: dict[str, tuple[Variant, list[tuple[str, dict]]]] = {}
            for v in sorted(variants, key=lambda v: len(v.chain)):  # a prefix's folder: the variant whose whole chain it is
                prefix = v.chain[:depth]
                if len(v.chain) < depth or any(_ident(v.chain[:d]) in failed for d in range(1, depth)):
                    continue
                if _ident(prefix) not in owners and cached_artifact(self.start, prefix, cache) is None:
                    owners[_ident(prefix)] = (v, prefix)
            futures: dict[str, Future] = {}
            for key, (v, prefix) in owners.items():
                folder = self.dir.work(v.name) / ("build" if len(v.chain) == depth else f"build-{depth}")
                what = f"build {v.name}" + ("" if len(v.chain) == depth else f" (step {depth})")
                self.progress.step(what)
                job = BuildJob(start=self.start, chain=[ChainStep(pass_name=n, params=p) for n, p in prefix], cache=str(cache),
                               source=self.model.ref(), calibration=self.ctx.calibration_path, tuning=self.ctx.tuning_path,
                               env=v.env)
                alone = get_pass(prefix[-1][0]).times_itself
                futures[key] = self.executor.submit(launch, job, folder, None, self.deadline(v), what=what, exclusive=alone)
            for key, future in futures.items():
                try:
                    built = future.result()
                except Lost as e:
                    failed[key] = str(e)
                    continue
                except OutOfTime as e:
                    failed[key] = str(e)
                    late.add(key)
                    continue
                if built.result is None:
                    failed[key] = f"build failed: {built.error}"
                else:
                    wall[key] = built.wall_s
        out: dict[str, tuple[object, float | None, str | None]] = {}
        for v in variants:
            why = next((failed[_ident(v.chain[:d])] for d in range(1, len(v.chain) + 1) if _ident(v.chain[:d]) in failed), None)
            if any(_ident(v.chain[:d]) in late for d in range(1, len(v.chain) + 1)):
                self.late[v.name] = str(why)
            artifact = None if why else cached_artifact(self.start, v.chain, cache)
            if artifact is None and why is None:
                why = "build failed: its artifact is missing after the build"
            out[v.name] = (artifact, wall.get(_ident(v.chain), 0.0), why)
        return out

    # ------------------------------------------------------------------------------------------------ measurements
    def _measure_job(self, u: Unit, artifact, reference: Record | None, ref_outputs: Path) -> MeasureJob:
        """The measurement of a variant; the original's (``reference`` None) saves the outputs the others are verified against."""
        v, s = u.variant, self.settings
        gate = None if reference is None or not v.gate else Gate(
            reference=reference.quality, max_drop_points=s.verify_max_drop,
            min_agreement=s.verify_min_agreement, min_cosine=s.verify_min_cosine)
        # The tuning samples judged too where the refinement ladder reads them: the original, a refined variant, a refinement
        tuned = self.ctx.tuning_path if reference is None or v.refines or any(c.refines == v.name for c in self.all_variants) else None
        ref_tuning = ref_outputs.with_name(f"{ref_outputs.stem}-tuning.npy")
        return MeasureJob(session=OpenSpec(name=v.name, artifact=artifact, runtime=v.runtime, options=v.options),
                          data=str(self.dir.eval_data), family=self.model.spec.family_name,
                          reference=None if reference is None else str(ref_outputs),
                          save_outputs=str(ref_outputs) if reference is None else None, protocol=self.protocol, gate=gate, env=v.env,
                          tuning_data=tuned, tuning_reference=str(ref_tuning) if tuned and reference is not None else None,
                          save_tuning_outputs=str(ref_tuning) if tuned and reference is None else None)

    def _merged(self, u: Unit, measured: Record, build_s: float | None) -> Record:
        """The measurement's record with the variant's own fields (key, chain …) and its build time."""
        base = self._base_record(u)
        if measured.status == "skipped":
            return base.model_copy(update={"status": "skipped", "error": measured.error})
        keep = {"key", "group", "chain", "description", "refines", "catalogue_index", "needs_gpu", "measured_for"}
        return measured.model_copy(update={**{k: getattr(base, k) for k in keep},
                                           "build_s": round(build_s, 2) if build_s is not None else None,
                                           "stage": "measure" if measured.status != "ok" else None})

    def _measure(self, units: list[Unit]) -> None:
        """Build the units' variants (nothing timed meanwhile), then measure each, one at a time per node. Each variant
        is charged an equal share of the builds and its own measurement (``spent``: what a time budget plans the next
        run with; an equal share of the round hid a torch.compile's 54 s behind its cheap round-mates)."""
        began = time.monotonic()
        own: dict[str, float] = {}
        try:
            self._build_and_measure(units, own)
        finally:
            rest = max(0.0, time.monotonic() - began - sum(own.values()))  # builds, and measurements not timed one by one
            for u in units:
                name = u.variant.name
                self.spent[name] = self.spent.get(name, 0.0) + own.get(name, 0.0) + rest / len(units)

    def _build_and_measure(self, units: list[Unit], own: dict[str, float]) -> None:
        available = {u.variant.name: runtime_available(u.variant.runtime) for u in units}
        to_build = list({u.variant.name: u.variant for u in units if available[u.variant.name][0] or self.distributed}.values())
        built = self._build(to_build) if to_build else {}
        pending: dict[Future, Unit] = {}
        for u in units:
            if not self.distributed and not available[u.variant.name][0]:
                self._record(u, self._base_record(u).model_copy(update={"status": "skipped", "error": available[u.variant.name][1]}))
                continue
            artifact, _, why = built[u.variant.name]
            if u.variant.name in self.late:
                self._not_finished(u, self.late[u.variant.name])
                continue
            if why is not None:
                self._record(u, self._base_record(u).model_copy(update={"status": "failed", "stage": "build", "error": why}))
                continue
            ref_kind = u.kind if u.kind in self.references else next(iter(self.references), None)
            reference = None if u.variant.is_original else self.references[ref_kind]
            job = self._measure_job(u, artifact, reference, self.dir.reference_outputs(u.kind if reference is None else ref_kind))
            self.progress.step(f"measuring {u.variant.name}{self._for(u.kind)}")
            started = time.monotonic()
            future = self.executor.submit(measure_variant, job, self.model.spec, self.dir.work(u.variant.name, u.kind),
                                          self.deadline(u.variant), resources=self.kinds[u.kind], what=f"measure {u.variant.name}{self._for(u.kind)}")
            if future.done():  # measured here: recorded at once, so a kill loses at most the measurement under way
                self._collect(u, future, built[u.variant.name][1])
                own[u.variant.name] = own.get(u.variant.name, 0.0) + time.monotonic() - started
            else:
                pending[future] = u
        for future in as_completed(pending):
            self._collect(pending[future], future, built[pending[future].variant.name][1])

    def _collect(self, u: Unit, future: Future, build_s: float | None) -> None:
        try:
            rec = self._merged(u, future.result(), build_s)
        except Lost as e:
            rec = self._base_record(u).model_copy(update={"status": "failed", "stage": "measure", "error": str(e)})
        except OutOfTime as e:
            self._not_finished(u, str(e))
            return
        self._record(u, rec)

    def _measure_originals(self, todo: list[Unit]) -> None:
        """The original first, on every kind that measures it: the others are verified against its outputs there."""
        self._measure([u for u in todo if u.variant.is_original])
        for k in self.kinds:
            rec = self.records.get((self.original.name, k))
            if rec is not None:
                self.references[k] = rec
        for k, rec in self.references.items():
            if rec.status != "ok":
                raise UserError(f"the original model could not be measured{self._for(k)}: {rec.error}",
                                fix="check the cluster, then rerun" if str(rec.error).startswith(LOST) else "check the model and data")
        if not self.references:
            raise UserError("the original model was not measured", fix="check the model, the data and --variants")

    def _screen(self, units: list[Unit]) -> None:
        """Build and screen ``units`` in rounds (a cluster: all at once), within the time budget."""
        size = max(1, len(units)) if self.distributed else BUILD_ROUND
        i = 0
        while i < len(units):
            fit = self._budget_fits(units[i:i + size])
            if fit == 0 and units[i].variant.is_baseline:
                fit = 1  # the baseline alone, whatever the budget: every ratio, the race and the report compare with it
            if fit == 0:  # this one does not fit what is left; a cheaper one further down the order may
                self.not_tried.append(LeftOut(name=units[i].variant.name, why=f"the time budget ({self.settings.budget}) ran "
                                              f"out after {self.elapsed():.0f} s: rerun with a larger --budget (finished variants are kept)"))
                i += 1
                continue
            self._measure(units[i:i + fit])
            i += fit

    def _budget_fits(self, units: list[Unit]) -> int:
        """How many of ``units`` (in order) fit the time budget with room left for the race's re-measures and the
        report: each costs what it took in an earlier run on this CPU, else this run's average so far (plus a compile
        for torch.compile); a round that does not fit whole is cut short rather than skipped."""
        budget = self.settings.budget_seconds
        if budget is None:
            return len(units)
        spent = [t for name, t in self.spent.items() if name != self.original.name]
        average = sum(spent) / len(spent) if spent else 15.0
        learned = racing.learned_seconds(self.family.name, cpu_features())
        # targets whose candidates are re-measured here: not a GPU target on a machine without one
        here = [t for t in self.targets if t.device.computes_on is not Device.GPU or gpu_present()] or self.targets
        measured = [r for r in self.records.values() if r.status == "ok" and r.phases]
        contenders = sum(r.name not in (self.original.name, self.baseline.name) for r in measured)
        axes = self.racing and bool(self.axes["grid"] or self.axes["length_batching"])
        remeasured = sum(t.device.computes_on is Device.CPU for t in here)  # interleave_candidates: CPU and edge targets
        total = 0.0
        for count, u in enumerate(units, 1):
            total += racing.expected_seconds(u.variant, learned, average)
            reserve = racing.finish_estimate(self.interleave_rounds, len(here), contenders + count, axes, remeasured,
                                             self.remeasure_turn())
            reserve += self.instance_reserve(contenders + count)
            if self.elapsed() + total + reserve > budget:
                return count - 1
        return len(units)

    def _misses_quality(self, rec: Record | None, kind: str | None) -> bool:
        """Whether a record failed, or misses a quality bound of a target of its kind on the tuning samples: the
        ladder's "recovered?" is a choice, so it must not see the held-out samples the verdict is judged on."""
        if rec is None or rec.status != "ok":
            return True
        ref = self.references.get(kind) or next(iter(self.references.values()))
        return any(racing.misses_quality(t, rec, ref, self.family, on_tuning=True) for t in self.targets_of(kind) or self.targets)

    def _refine(self, units: list[Unit]) -> None:
        """Variants that only recover quality another one lost (``Variant.refines``), per variant refined and kind of
        node: none when that one meets every quality bound; else those running the same kernels one by one, cheapest
        first (the catalogue's order), until one meets every bound — the others cannot be faster; those that may run
        slower kernels only when none of them did. The groups go most promising first (the race's order): a fast
        recovered variant measured early shows a slower base hopeless even with its quality back, so its refinements
        (NNCF's accuracy control: 98 s of a 464 s demo) are never built."""
        for (base, kind), group in racing.refinement_groups(units, self.family.name, cpu_features()):
            probe = self.records.get((base, kind))
            if not self._misses_quality(probe, kind):
                for u in group:
                    self.not_tried.append(LeftOut(name=u.variant.name, why=f"not built: {base} already meets every quality "
                                                  "bound (this only recovers quality it would lose; --full builds it)"))
                continue
            ref = self.references.get(kind) or next(iter(self.references.values()))
            mine = [r for (_, k), r in self.records.items() if k == kind]
            targets = self.targets_of(kind) or self.targets
            hopeless = racing.beaten_even_if_recovered(targets, probe, mine, ref, self.family) if probe is not None else None
            if hopeless is None and probe is not None and (rivals := racing.challengers(targets, probe, mine, ref, self.family)):
                side = self._side_by_side(probe, rivals, kind)
                hopeless = racing.beaten_side_by_side(targets, probe, side, mine, ref, self.family) if side else None
            if hopeless:
                for u in group:
                    self.not_tried.append(LeftOut(name=u.variant.name, why=f"not built: even with its quality recovered, {base}'s "
                                                  f"kernels (which this runs, or slower ones) are beaten: {hopeless}"))
                continue
            recovered = None
            tried: list[str] = []
            tolerance = min(t.max_accuracy_drop for t in targets)
            for u in sorted(group, key=lambda u: not u.variant.same_kernels):  # stable: the catalogue's order within each
                if recovered is not None:
                    self.not_tried.append(LeftOut(name=u.variant.name, why=f"not built: {recovered} already recovers the "
                                                  f"quality {base} loses, with the same INT8 kernels (--full builds it)"))
                    continue
                measured = [self.records.get((n, kind)) for n in (base, *tried)]
                drops = [self.family.quality_drop(racing.tuning_view(r), racing.tuning_view(ref))  # a choice: on tuning samples
                         if r is not None and r.status == "ok" else None for r in measured]
                search = sum(get_pass(name).slow_seconds for name, _ in u.variant.chain)  # a search: minutes, not seconds
                if search and (hopeless := racing.refinement_hopeless(drops, tolerance, len(tried))):
                    self.not_tried.append(LeftOut(name=u.variant.name, why=f"not built (a search of about {search:.0f} s): {hopeless}"))
                    continue
                self._screen([u])
                tried.append(u.variant.name)
                if u.variant.same_kernels and not self._misses_quality(self.records.get((u.variant.name, kind)), kind):
                    recovered = u.variant.name

    def _side_by_side(self, probe: Record, rivals: list[str], kind: str | None) -> dict[str, SideBySide]:
        """``probe`` and the variants ahead of it on their screening figures, alternated in one process (the screening
        protocol, ``interleave_rounds`` rounds): a few seconds that settle whether a long refinement of ``probe`` (NNCF's
        accuracy control: 80-100 s here) can win anything. Empty when they cannot run side by side here."""
        by_name = {r.name: r for (_, k), r in self.records.items() if k == kind and r.status == "ok" and r.artifact is not None}
        names = _joining([probe.name, *rivals], by_name)
        if probe.name not in names or len(names) < 2:
            return {}
        job = self._interleave_job(names, by_name, probe.name, self.protocol, max(3, self.interleave_rounds))
        label = f"side-by-side-{probe.name}"
        self.progress.step(f"{probe.name} side by side with {', '.join(names[1:])}{self._for(kind)}")
        try:
            launched = self.executor.submit(launch, job, self.dir.work_root / label, None, self.finish_deadline(),
                                            resources=self.kinds.get(kind), what=label).result()
        except Lost:
            return {}
        except OutOfTime as e:
            self._out_of_time(f"the side-by-side run of {', '.join(names)}", e)
            return {}
        return dict(launched.result.variants) if launched.result is not None else {}

    # ------------------------------------------------------------------------------------------------ the race
    def _race_and_cold_start(self) -> None:
        """Screen out, per kind of node, what is beaten beyond noise for every target; cold-start the contenders."""
        pending: dict[Future, tuple[Unit, Record]] = {}
        by_unit = {(u.variant.name, u.kind): u for u in self.units}
        for kind in self.kinds:
            records = [r for (n, k), r in self.records.items() if k == kind]
            reference = self.references.get(kind) or next(iter(self.references.values()))
            keep = {self.original.name, self.baseline.name}
            # The original and the baseline are never marked screened out (every figure is compared with them: their cold
            # starts too), but an original beaten beyond noise is no contender: it gets no side-by-side re-measure.
            beaten = racing.screened_out(self.targets_of(kind) or self.targets, records, reference, self.family, set()) \
                if self.racing else {}
            self.beaten[kind] = set(beaten) - {self.baseline.name}
            for rec in records:
                u = by_unit.get((rec.name, kind))
                if u is None or rec.status != "ok":
                    continue
                if rec.name in beaten and rec.name not in keep and rec.screened_out is None and rec.cold_start is None:
                    self._update(u, rec.model_copy(update={"screened_out": beaten[rec.name]}))
                elif (rec.name not in beaten or rec.name in keep) and rec.cold_start is None and rec.artifact is not None:
                    job = ColdStartJob(session=OpenSpec(name=rec.name, artifact=rec.artifact, runtime=rec.runtime, options=rec.options),
                                       spec=self.model.spec, env=rec.env)
                    self.progress.step(f"cold start of {rec.name}{self._for(kind)}")
                    future = self.executor.submit(cold_start, job, self.dir.work(rec.name, kind) / "coldstart", self.finish_deadline(),
                                                  resources=self.kinds[kind], what=f"cold start {rec.name}{self._for(kind)}")
                    pending[future] = (u, rec)
        for future in as_completed(pending):
            u, rec = pending[future]
            try:
                cold = future.result()
            except Lost as e:
                cold = ColdStart(error=str(e))
            self._update(u, rec.model_copy(update={"cold_start": cold, "screened_out": None}))

    def _update(self, u: Unit, rec: Record, fields: tuple[str, ...] = ("cold_start", "screened_out")) -> None:
        """A record completed after screening (its cold start, what screened it out, a pick's axes), kept in race.jsonl by
        key: results.jsonl keeps one line per measurement."""
        append_jsonl(self.dir.race, {"key": rec.key, **rec.model_dump(mode="json", include=set(fields))})
        self.records[(u.variant.name, u.kind)] = rec

    def _axes_of_picks(self, decisions: dict[str, Decision]) -> None:
        """A racing sweep measured no variant's own axes (a text encoder's grid, its real texts by batching order): the
        picks (and the baseline, to compare with) get them now, each in its own process, alone on the machine."""
        axes = self.axes
        if not self.racing or not (axes["grid"] or axes["length_batching"]):
            return
        by_unit = {(u.variant.name, u.kind): u for u in self.units}
        wanted = [(d.recommended or d.nearest, d.result.measured_for if d.result else None) for d in decisions.values()]
        wanted += [(self.baseline.name, k) for k in self.kinds]
        for name, kind in dict.fromkeys(w for w in wanted if w[0]):
            rec, u = self.records.get((name, kind)), by_unit.get((name, kind))
            if rec is None or u is None or rec.status != "ok" or rec.artifact is None or rec.grid or rec.length_batching:
                continue
            proto = self.protocol.model_copy(update={**axes, "axes_only": True})
            job = MeasureJob(session=OpenSpec(name=name, artifact=rec.artifact, runtime=rec.runtime, options=rec.options),
                             data=str(self.dir.eval_data), family=self.model.spec.family_name, protocol=proto, env=rec.env)
            self.progress.step(f"measuring {name}'s batch × length grid{self._for(kind)}")
            m = self._result_or_problem(job, self.dir.work(name, kind) / "axes", kind, f"axes {name}",
                                        f"the grid of {name} was not measured")
            if m is None:
                continue
            self._update(u, rec.model_copy(update={"grid": m.grid, "length_batching": m.length_batching,
                                                   "phases": [*rec.phases, *m.phases]}),
                         fields=("grid", "length_batching", "phases"))

    def _result_or_problem(self, job, folder: Path, kind: str | None, what: str, problem: str):
        """A job's result, or None with ``problem`` and why noted for the report (the run goes on without it)."""
        try:
            launched = self.executor.submit(launch, job, folder, None, self.finish_deadline(), resources=self.kinds.get(kind),
                                            what=what).result()
        except Lost as e:
            self.problems.append(f"{problem}: {e}")
            return None
        except OutOfTime as e:
            self._out_of_time(problem, e)
            return None
        if launched.result is None:
            self.problems.append(f"{problem}: {launched.error}")
        return launched.result

    # ------------------------------------------------------------------------------------------------ re-measures
    def run_interleave(self, names: list[str], records: list[Record], isa: str | None = None, kind: str | None = None) -> Interleaved | None:
        """Candidates and the baseline, side by side in one process (cached by the set measured). With ``isa``, every
        runtime that can be held to that instruction set is (its environment variables for the whole process), and each
        variant's figures say whether its runtime was. ``kind``: on a node of that kind (its records)."""
        baseline = self.baseline.name
        by_name = {r.name: r for r in records if r.status == "ok"}
        if baseline not in by_name:
            return None
        names = [*_joining(names, by_name, baseline), baseline]
        caps = {n: get_runtime(by_name[n].runtime).isa_cap_env(isa) if isa else None for n in names}
        path, label = self.dir.interleave(kind, isa), self.dir.interleave_label(kind, isa)

        def key(rounds: int) -> str:
            return json.dumps([sorted(str(by_name[n].key) for n in names), rounds, self.interleave_protocol.model_dump(), isa])

        previous = _stored_interleaved(path)  # a budget may have cut its rounds short: still the same measurement
        if previous is not None and previous.cache_key in {key(r) for r in range(2, self.interleave_rounds + 1)}:
            self.reused.append(f"side-by-side re-measure {label}" + (f" and its {len(previous.duels)} duel(s)" if previous.duels else ""))
            return previous
        rounds = self.interleave_rounds
        if (deadline := self.finish_deadline()) is not None:  # rounds that fit what the budget leaves, sized by the calls
            per_round = sum(racing.remeasure_seconds(by_name[n], self.interleave_protocol) + 2.0 for n in names)
            fit = int((deadline - time.time() - self.instance_reserve(len(names))) // per_round)
            if fit < 2:
                self.problems.append(f"the side-by-side re-measure {label} was not run: a round of {len(names)} variants takes "
                                     f"about {per_round:.0f} s and the time budget ({self.settings.budget}) leaves less than "
                                     "two; decided on the screening figures (rerun with a larger --budget)")
                return None
            rounds = min(rounds, fit)
        cache_key = key(rounds)
        job = self._interleave_job(names, by_name, baseline, self.interleave_protocol, rounds, caps)
        try:
            launched = self.executor.submit(launch, job, self.dir.work_root / label, None, self.finish_deadline(),
                                            resources=self.kinds.get(kind), what=label).result()
        except Lost as e:
            raise UserError(f"interleaved re-measure {label}: {e}", fix="check the cluster, then rerun") from e
        except OutOfTime as e:
            self._out_of_time(f"the side-by-side re-measure {label} (decided on the screening figures)", e)
            return None
        if launched.result is None:
            raise UserError(f"interleaved re-measure {label} failed: {launched.error}", fix=f"see work/{label}/job.log")
        variants = {n: v.model_copy(update={"isa_cap": isa if caps.get(n) else None}) for n, v in launched.result.variants.items()}
        result = launched.result.model_copy(update={"cache_key": cache_key, "variants": variants})
        write_json_atomic(path, result)
        return result

    def _interleave_job(self, names: list[str], by_name: dict[str, Record], reference: str, protocol: Protocol, rounds: int,
                        caps: dict[str, dict[str, str] | None] | None = None) -> InterleaveJob:
        return interleave_job(names, by_name, reference, self.dir.eval_data, protocol, rounds, caps)

    def run_alternating(self, names: list[str], records: list[Record], interleaved: Interleaved, kind: str | None) -> Interleaved:
        """Candidates whose runtime lives in an environment of its own cannot join the interleaved process: each is
        measured alternately with the baseline, a fresh process per round (``bench.alternate``), its figures scaled to
        the baseline's in the interleaved run, so it can win a CPU target like any other (cached by the set measured)."""
        by_name = {r.name: r for r in records if r.status == "ok" and r.artifact is not None}
        own = [n for n in names if n in by_name and get_runtime(by_name[n].runtime).environment() is not None]
        anchor = interleaved.variants.get(self.baseline.name)
        if not own or anchor is None:
            return interleaved
        path = self.dir.interleave(kind).with_name(self.dir.interleave_label(kind) + "-alternating.json")
        cache_key = json.dumps([sorted(str(by_name[n].key) for n in [*own, self.baseline.name]), self.interleave_rounds,
                                self.interleave_protocol.model_dump(), interleaved.cache_key])
        cached = json.loads(path.read_text()) if path.exists() else None
        if cached and cached.get("cache_key") == cache_key:
            alternated = {n: SideBySide.model_validate(v) for n, v in cached["variants"].items()}
            self.reused.append(f"alternating re-measure of {', '.join(own)}{self._for(kind)}")
        else:
            jobs = {n: MeasureJob(session=OpenSpec(name=n, artifact=by_name[n].artifact, runtime=by_name[n].runtime,
                                                   options=by_name[n].options), data=str(self.dir.eval_data),
                                  family=self.model.spec.family_name, protocol=self.interleave_protocol.model_copy(
                                      update={"cold_start": False, "grid": [], "length_batching": False}), env=by_name[n].env)
                    for n in [self.baseline.name, *own]}
            self.progress.step(f"re-measuring {', '.join(own)} process by process with the baseline")
            try:
                future = self.executor.submit(alternate, jobs, self.interleave_rounds, self.dir.work("alternating", kind),
                                              self.finish_deadline(),
                                              resources=self.kinds.get(kind), what="alternating re-measure")
                alternated = ratios(future.result(), self.baseline.name, anchor)
            except (AlternationFailed, Lost) as e:
                self.problems.append(f"alternating re-measure of {', '.join(own)} failed: {e} — their sweep figures are not compared")
                return interleaved
            except OutOfTime as e:
                self._out_of_time(f"the alternating re-measure of {', '.join(own)} (their sweep figures are not compared)", e)
                return interleaved
            write_json_atomic(path, {"cache_key": cache_key, "variants": {n: v.model_dump() for n, v in alternated.items()}})
        alternated.pop(self.baseline.name, None)
        return interleaved.model_copy(update={"variants": {**interleaved.variants, **alternated},
                                              "order": [*interleaved.order, *alternated]})

    def duel_seconds(self, figures: int) -> float | None:
        """How long a duel may take per figure: ``racing.DUEL_SECONDS_PER_FIGURE``, or what the time budget leaves after
        loading the duel and the finish (profiles, the report), split between its figures; None when that is under
        ``racing.DUEL_MIN_SECONDS``."""
        most = 0.5 if self.settings.quick else racing.DUEL_SECONDS_PER_FIGURE
        budget = self.settings.budget_seconds
        if budget is None:
            return most
        # the instance's answer (scaling, the capacity search) comes after the duel: its time is kept for it
        left = (budget - self.elapsed() - racing.DUEL_LOAD_SECONDS - racing.closing_seconds(len(self.targets))
                - self.instance_reserve(3)) / max(1, figures)
        return min(most, left) if left >= min(most, racing.DUEL_MIN_SECONDS) else None

    def settle_ties(self, targets: list[Target], records: list[Record], reference: Record | None, interleaved: Interleaved,
                    kind: str | None) -> Interleaved:
        """The close calls the interleaved rounds leave (the rounds are seconds apart, and a round moves a figure by
        more than the gaps that matter): each CPU or edge target's pick and up to ``racing.DUEL_RIVALS`` rivals
        (``decide.unsettled``: tied with it, or within the drift) take turns block by block in one process
        (``bench.duel``) on the target's speed figures; the duels' verdicts replace the rounds' for the pairs they
        cover (``decide.surely_ahead``). Stored with the rounds, with how many duel jobs ran (a resumed run measures
        nothing the first run settled or stopped at); under a time budget, only in the time it leaves."""
        by_name = {r.name: r for r in records if r.status == "ok" and r.artifact is not None}
        while interleaved.settle_rounds < racing.DUEL_SETTLE_ROUNDS:
            names, asked = unsettled(targets, records, reference, self.family, interleaved, racing.DUEL_RIVALS)
            if interleaved.covers(names, asked):
                break
            seconds = self.duel_seconds(len(asked))
            if seconds is None:
                self.problems.append(f"the close call of {', '.join(names)} was not settled block by block: the time budget "
                                     f"({self.settings.budget}) ran out; the simplest recipe of them is picked")
                break
            self.progress.step(f"settling a close call: {', '.join(names)} taking turns block by block")
            job = duel_job(names, by_name, self.dir.eval_data, asked, seconds, self.interleave_protocol.batch_size,
                           min_pairs=3 if self.settings.quick else 8)
            # a folder per kind: on a cluster the kinds settle their close calls at once, and two jobs launched into
            # one folder read each other's job.json (a kind got the other's duel, and a resumed run dueled again)
            result = self._result_or_problem(job, self.dir.work("duel", kind), kind, "duel",
                                             f"the close call of {', '.join(names)} was not settled")
            if result is None:
                break
            interleaved = interleaved.with_duels(result.duels).model_copy(update={"settle_rounds": interleaved.settle_rounds + 1})
            stored = _stored_interleaved(self.dir.interleave(kind))
            if stored is not None:  # kept with the rounds it settles: a resumed run measures it again only if they change
                write_json_atomic(self.dir.interleave(kind), stored.model_copy(
                    update={"duels": interleaved.duels, "settle_rounds": interleaved.settle_rounds}))
        return interleaved

    def run_capped(self, records: list[Record], reference: Record | None, kind: str | None, targets: list[Target]) -> dict[str, Interleaved]:
        """For each CPU target that names a poorer instruction set than the measuring machine's, its candidates
        re-measured with the runtimes held to that instruction set where they can be (oneDNN / ATen caps)."""
        capped: dict[str, Interleaved] = {}
        env = next((r.environment for r in records if r.status == "ok" and r.environment), None)
        # The measuring machine: this one, or on a cluster the nodes of this kind (their records say which CPU).
        here = CpuFeatures(frozenset(env.cpu_flags)).level if self.distributed and env else cpu_features().level
        for t in targets:
            if t.device is not Device.CPU or t.isa is None or t.isa in capped or not richer(here, t.isa):
                continue
            names = interleave_candidates([t], records, reference, self.family)
            # the candidates were ranked on uncapped figures: one whose runtime is capped may fall far behind (OpenVINO
            # INT8 held to AVX2 here: 613 → 121/s), so the leaders among the runtimes that cannot be capped (their
            # figures stand) join too, or the target is decided without its best answer (the demo's cpu-server was)
            standing = [r for r in records if get_runtime(r.runtime).isa_cap_env(t.isa) is None]
            names = list(dict.fromkeys([*names, *interleave_candidates([t], standing, reference, self.family, per_target=2)]))
            if not racing.cap_changes(names, records, t.isa):
                self.problems.append(f"{t.name}: no candidate's runtime can be held to {t.isa}; its figures stand uncapped")
                continue
            self.progress.step(f"re-measuring {t.name}'s candidates with the instruction set capped at {t.isa}")
            try:
                result = self.run_interleave(names, records, isa=t.isa, kind=kind)
            except UserError as e:
                self.problems.append(f"{t.name}: {e.problem} — decided on the uncapped figures")
                continue
            if result is not None:
                capped[t.isa] = result
        return capped

    def instance_reserve(self, contenders: int) -> float:
        """Seconds the instance's answer takes at the end (``racing.instance_seconds``): the scaling of up to three
        candidates and the baseline per target naming an instance, and a capacity search per priced one with an SLO."""
        mine = self.instance_targets(self.targets)
        if not mine:
            return 0.0
        from servopt.bench.scaling import machine_cores

        candidates = min(contenders, 3 * len(mine)) + 1
        priced = sum(t.price_per_hour is not None and t.max_p99_ms is not None for t in mine) if self.capacity_probe else 0
        cores = machine_cores()
        return racing.instance_seconds(candidates, cores, priced, self.batch_call_seconds() * cores)

    def _baseline_record(self) -> Record | None:
        return next((r for (n, _), r in self.records.items() if n == self.baseline.name and r.status == "ok"), None)

    def remeasure_turn(self) -> float:
        """Seconds one candidate's turn in a side-by-side round takes, sized by the baseline's measured calls (a 12-layer
        encoder's are 5x a CNN's): what the budget reserves for the re-measures is then what they will take."""
        rec = self._baseline_record()
        return racing.remeasure_seconds(rec, self.interleave_protocol) if rec is not None else 4.0

    def batch_call_seconds(self) -> float:
        """One batch call of the baseline on all cores (0 before it is measured)."""
        rec = self._baseline_record()
        tp = rec.throughput_ips.batch if rec is not None and rec.throughput_ips is not None else None
        return self.interleave_protocol.batch_size / tp if tp else 0.0

    def instance_targets(self, targets: list[Target]) -> list[Target]:
        """The targets naming an instance whose figures this machine (or this kind's nodes) can take: a CPU's."""
        return [t for t in targets if t.instance_vcpus is not None and t.device is Device.CPU]

    def run_scaling(self, targets: list[Target], records: list[Record], reference: Record | None,
                    interleaved: Interleaved | None, capped: dict[str, Interleaved], kind: str | None) -> Scaling | None:
        """The candidates of the targets naming an instance (every variant their decision can pick: those re-measured
        side by side), at 1, 2, … cores in the layout ``servopt serve`` runs (``bench.scaling``), in one process,
        alternating rounds; held to a target's poorer instruction set where a runtime can be, as its re-measure was.
        Cached by the set measured: a resumed run measures nothing again."""
        mine = self.instance_targets(targets)
        if not mine:
            return None
        by_name = {r.name: r for r in records if r.status == "ok" and r.artifact is not None}
        pool: list[str] = []
        for t in mine:  # the variants its decision picks among: those its (capped) side-by-side run re-measured
            side = capped.get(t.isa or "") or interleaved
            pool += list(side.variants) if side else interleave_candidates([t], records, reference, self.family)
        names = _joining(list(dict.fromkeys(pool)), by_name)
        if not names:
            return None
        isa = next((t.isa for t in mine if t.isa and t.isa in capped), None)
        caps = {n: get_runtime(by_name[n].runtime).isa_cap_env(isa) if isa else None for n in names}
        quick = self.settings.quick
        rounds, seconds = (2, 0.1) if quick else (3, racing.SCALING_SECONDS)
        cache_key = json.dumps([sorted(str(by_name[n].key) for n in names), rounds, seconds, isa])
        path = self.dir.scaling(kind)
        if path.exists():
            stored = Scaling.model_validate_json(path.read_text())
            if stored.cache_key == cache_key:
                return stored
        sessions, env = _one_process(names, by_name, caps)
        # on a node of the target's kind with as many cores as the instance, its figure is measured, not projected
        job = ScalingJob(sessions=sessions, data=str(self.dir.eval_data), batch_size=self.interleave_protocol.batch_size,
                         rounds=rounds, seconds=seconds, isa_cap=isa, env=env, max_cores=max(t.instance_vcpus or 1 for t in mine))
        self.progress.step(f"measuring how {', '.join(names)} scale with cores{self._for(kind)}")
        result = self._result_or_problem(job, self.dir.work_root / path.stem, kind, "scaling",
                                         "the candidates' scaling was not measured: the instance's bounds are not judged")
        if result is None:
            return None
        result = result.model_copy(update={"cache_key": cache_key})
        write_json_atomic(path, result)
        return result

    def run_capacity(self, targets: list[Target], decided: Callable[[Target, list[Capacity]], Decision], records: list[Record],
                     kind: str | None) -> dict[str, list[Capacity]]:
        """Per target with a price and an SLO (``max_p99_ms``) naming an instance: its pick served (``servopt serve``)
        and the serving configuration with the most capacity within the SLO searched (``capacity_probe``), in the time
        the budget leaves (``racing.CAPACITY_SECONDS`` at most each). When the served capacity moves the pick (the pick
        misses on it, another passes on its offline figures), the new pick is served too, up to ``racing.CAPACITY_PICKS``:
        a pick is never chosen over a served figure on an offline one while there is time to serve it. Cached per
        target, variant and SLO."""
        out: dict[str, list[Capacity]] = {}
        by_name = {r.name: r for r in records if r.status == "ok" and r.artifact is not None}
        for t in self.instance_targets(targets):
            if t.price_per_hour is None or t.max_p99_ms is None or self.capacity_probe is None:
                continue
            found: list[Capacity] = []
            for _ in range(racing.CAPACITY_PICKS):
                d = decided(t, found)
                pick = d.recommended or d.nearest
                if pick not in by_name or any(c.variant == pick for c in found):
                    break
                capacity = self._capacity_of(t, by_name[pick], kind)
                if capacity is None:
                    if found:
                        self.problems.append(f"{t.name}: {pick} became the pick once {found[-1].variant}'s served capacity "
                                             f"missed, but was not served itself: judged on its offline figures")
                    break
                found.append(capacity)
            if found:
                out[t.name] = found
        return out

    def _capacity_of(self, t: Target, rec: Record, kind: str | None) -> Capacity | None:
        """One variant's capacity within ``t``'s SLO (cached), or None with the reason in ``problems``."""
        pick = rec.name
        if not get_runtime(rec.runtime).servable:
            self.problems.append(f"{t.name}: {pick} runs on {rec.runtime}, which servopt serve does not run: priced offline")
            return None
        quick = self.settings.quick
        cache_key = json.dumps([rec.key, t.max_p99_ms, quick])
        path = self.dir.capacity(t.name, pick)
        if path.exists():
            stored = json.loads(path.read_text())
            if stored.get("cache_key") == cache_key:
                return Capacity.model_validate(stored["capacity"])
        seconds = racing.CAPACITY_SECONDS if not quick else 15.0
        budget = self.settings.budget_seconds
        if budget is not None:
            seconds = min(seconds, budget - self.elapsed() - racing.closing_seconds(len(self.targets)))
            if seconds < racing.CAPACITY_MIN_SECONDS and not quick:
                self.problems.append(f"{t.name}: the time budget ({self.settings.budget}) left no time to serve {pick} and "
                                     "search its capacity within the SLO: priced on the offline figures")
                return None
        # half the offline rate, at most 200/s: a served request costs the HTTP front end and the load generator (on
        # the same cores) far more than a tiny model's call, and the search doubles from there in a few steps
        start = min(200.0, max(1.0, 0.5 * (rec.batch_ips or rec.throughput_ips or 20.0)))
        self.progress.step(f"serving {pick}: its capacity within p99 <= {t.max_p99_ms:g} ms{self._for(kind)}")
        try:
            capacity = self.executor.submit(self.capacity_probe, self.out, pick, 99, t.max_p99_ms, start, seconds, quick,
                                            resources=self.kinds.get(kind), what=f"capacity {pick}").result()
            if stopping():  # its servers were stopped mid-search: not a capacity to keep
                raise Interrupted(f"the capacity search of {pick} was stopped")
        except Lost as e:
            self.problems.append(f"{t.name}: the capacity search of {pick} was lost: {e}")
            return None
        if capacity.error:
            self.problems.append(f"{t.name}: the capacity search of {pick} failed: {capacity.error} — priced on the offline figures")
            return None
        write_json_atomic(path, {"cache_key": cache_key, "capacity": capacity.model_dump(mode="json")})
        return capacity

    def profile_variants(self, names: list[str], records: list[Record], kind: str | None = None) -> None:
        """Op-level profiles of the recommended variants, each in its own process (a measurement, so not in the report
        step: ``servopt report`` only reads), cached; a failed profile is stored with its reason."""
        by_name = {r.name: r for r in records}
        for name in dict.fromkeys(names):
            rec = by_name.get(name)
            if rec is None or rec.artifact is None or load_profile(self.out, name, kind) is not None:
                continue
            self.progress.step(f"profiling {name}{self._for(kind)}")
            job = ProfileJob(session=OpenSpec(name=name, artifact=rec.artifact, runtime=rec.runtime, options=rec.options),
                             data=str(self.dir.eval_data), env=rec.env)
            try:
                launched = self.executor.submit(launch, job, self.dir.work(name, kind) / "profile", None,
                                                self.finish_deadline(closing=False), resources=self.kinds.get(kind),
                                                what=f"profile {name}").result()
                prof = launched.result or OpProfile(variant=name, profiler="none", total_ms_per_run=0.0, error=launched.error)
            except Lost as e:
                prof = OpProfile(variant=name, profiler="none", total_ms_per_run=0.0, error=str(e))
            except OutOfTime as e:  # not stored: a rerun with more time profiles it
                self._out_of_time(f"the profile of {name}", e)
                continue
            write_json_atomic(self.dir.profile(name, kind), prof)

    # ------------------------------------------------------------------------------------------------ finish
    def _finish_kind(self, kind: str | None, records: list[Record]) -> KindOutcome:
        """One kind of node (one machine: the only one): the side-by-side re-measure of its targets' top candidates, the
        capped re-measures, and its targets' decisions, on its own records only."""
        targets = self.targets_of(kind)
        reference = self.references.get(kind) or next(iter(self.references.values()))
        contenders = [r for r in records if r.screened_out is None and r.name not in self.beaten.get(kind, set())]
        self.progress.step(f"re-measuring the top candidates side by side with the reference{self._for(kind)}")
        names = interleave_candidates(targets, contenders, reference, self.family)
        interleaved = None
        if names:
            try:
                interleaved = self.run_interleave(names, records, kind=kind)
            except UserError as e:
                self.problems.append(f"{e.problem} — decided on the sweep's figures")
        if interleaved is not None:
            interleaved = self.run_alternating(names, records, interleaved, kind)
            interleaved = self.settle_ties(targets, records, reference, interleaved, kind)
        capped = self.run_capped(contenders, reference, kind, targets)
        scaling = self.run_scaling(targets, records, reference, interleaved, capped, kind)

        def decided(t: Target, capacities: list[Capacity] | None = None) -> Decision:
            return decide(t, records, reference, self.family, capped.get(t.isa or "") or interleaved, scaling, capacities)

        capacities = self.run_capacity(targets, decided, records, kind)
        decisions = {t.name: pricing.priced(decided(t, capacities.get(t.name)), records, self.settings.load_ips) for t in targets}
        return KindOutcome(decisions, interleaved, capped, pareto_front(records, reference, self.family), scaling)

    def _decide_now(self, kind: str | None, records: list[Record]) -> KindOutcome:
        """An interrupted run's decisions for one kind of node: on the screening figures, nothing re-measured."""
        reference = self.references.get(kind) or next(iter(self.references.values()), None)
        decisions = {t.name: pricing.priced(decide(t, records, reference, self.family, None), records, self.settings.load_ips)
                     for t in self.targets_of(kind)}
        return KindOutcome(decisions, None, {}, pareto_front(records, reference, self.family))

    def _interrupted(self) -> None:
        """What an interrupted run did not finish, in ``not_tried`` and ``problems``."""
        listed = {v.name for v in self.not_tried}
        for u in self.units:
            if (u.variant.name, u.kind) not in self.records and u.variant.name not in listed:
                listed.add(u.variant.name)
                self.not_tried.append(LeftOut(name=u.variant.name, why="not finished: the run was interrupted (SIGINT/SIGTERM) "
                                              "before it was measured: rerun the same command to finish it"))
        self.problems.append(f"interrupted after {self.elapsed():.0f} s: the picks are the best answer from the figures measured "
                             "by then, without the side-by-side re-measure of the contenders; rerun the same command to finish "
                             "(finished variants are kept)")

    def _per_kind(self, work: Callable, kinds: Iterable) -> list:
        """``work`` for each kind: one after another here, all kinds at once on a cluster (each on its own nodes)."""
        kinds = list(kinds)
        if not self.distributed or len(kinds) < 2:
            return [work(k) for k in kinds]
        with ThreadPoolExecutor(len(kinds)) as pool:
            return list(pool.map(work, kinds))

    def _finish(self, interrupted: bool = False) -> Summary:
        """Decide per target (after the interleaved re-measure), profile the picks, write summary.json and the reports.
        ``interrupted``: nothing more is measured (the jobs are stopped): decided on the figures so far, what was not
        finished listed as not tried, summary.json and the reports marked interrupted."""
        names = [v.name for v in self.chosen]
        records = [self.records[(u.variant.name, u.kind)] for u in self.units if (u.variant.name, u.kind) in self.records]
        records.sort(key=lambda r: names.index(r.name))
        of_kind = {k: [r for r in records if r.measured_for == k] for k in self.kinds}
        finish = self._decide_now if interrupted else self._finish_kind
        outcomes = dict(zip(self.kinds, self._per_kind(lambda k: finish(k, of_kind[k]), self.kinds), strict=True))
        decisions = {name: d for o in outcomes.values() for name, d in o.decisions.items()}
        if interrupted:
            self._interrupted()
        else:
            self._axes_of_picks(decisions)
        records = [self.records[(r.name, r.measured_for)] for r in records]  # with the picks' axes
        of_kind = {k: [r for r in records if r.measured_for == k] for k in self.kinds}
        decisions = {name: d if d.result is None else d.model_copy(update={"result": self.records[(d.result.name, d.result.measured_for)]})
                     for name, d in decisions.items()}
        here = outcomes.get(None)  # one machine, or the targets of a distributed sweep that name no resources
        by_kind = [KindSummary(kind=k, ray_resources=self.kinds[k] or {}, targets=[t.name for t in self.targets_of(k)],
                               nodes=sorted({r.environment.node for r in of_kind[k] if r.environment and r.environment.node}),
                               interleaved=o.interleaved, capped=o.capped, pareto_front=o.pareto_front, scaling=o.scaling,
                               environment=self.references[k].environment if k in self.references else None)
                   for k, o in outcomes.items() if k is not None]
        primary = next((k for k in self.kinds if k in self.references), None)
        reference = self.references.get(primary)
        summary = Summary(
            created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), run_dir=str(self.out), reference=reference.name if reference else None,
            reference_ort=self.baseline.name if any(r.name == self.baseline.name for r in records) else None,
            targets=[decisions[t.name] for t in self.targets], pareto_front=here.pareto_front if here else [],
            interleaved=here.interleaved if here else None, capped=here.capped if here else {},
            scaling=here.scaling if here else None,
            counts={s: sum(r.status == s for r in records) for s in ("ok", "failed", "skipped")},
            environment=environment(libraries=all_libraries()), kinds=by_kind, problems=self.problems,
            not_tried=self.not_tried, racing=self.racing, budget_s=self.settings.budget_seconds, wall_s=round(self.elapsed(), 1),
            reused=self.reused, load_ips=self.settings.load_ips, interrupted=interrupted)
        write_json_atomic(self.dir.summary, summary)
        if interrupted:  # no profile, no history: a stopped run measures nothing more and teaches nothing
            from servopt.optimize.report import write_reports

            write_reports(self.out, summary, records)
            return summary

        def profile(kind: str | None) -> None:
            picks = [d.recommended or d.nearest for d in (decisions[t.name] for t in self.targets_of(kind))]
            self.profile_variants([p for p in picks if p], of_kind[kind], kind)

        self._per_kind(profile, self.kinds)
        racing.remember(self.family.name, cpu_features(), records, self.baseline.name, self.spent)
        from servopt.optimize.report import write_reports

        self.progress.step("writing the report")
        write_reports(self.out, summary, records)
        return summary
