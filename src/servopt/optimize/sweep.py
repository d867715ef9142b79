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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from servopt.bench.launcher import Interrupted, stopping
from servopt.bench.protocol import Protocol
from servopt.contracts import Capacity, ChainStep, Interleaved, Record, Scaling
from servopt.cpu import Isa, capped_features
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.families.base import Family, family_of
from servopt.machine import Device, cpu_features, environment
from servopt.models.sources import LoadedModel
from servopt.optimize import pricing, racing
from servopt.optimize.budget import Budget
from servopt.optimize.builds import BUILD_ROUND, SweepBuilds, Unit, measure_variant, runtime_available  # noqa: F401 (re-exported)
from servopt.optimize.candidates import interleave_candidates, pareto_front
from servopt.optimize.decide import Decision, decide
from servopt.optimize.executor import LOST, Executor, LocalExecutor
from servopt.optimize.instance import SweepInstance
from servopt.optimize.remeasure import (  # noqa: F401 (re-exported: tests and the duel benchmark import them here)
    SweepRemeasures,
    _stored_interleaved,
    as_served,
    cold_start,
    duel_job,
    interleave_job,
)
from servopt.optimize.rundir import KindSummary, LeftOut, RunConfig, RunDir, Summary
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
    chain_data_key,
    dataset_digest,
    source_artifact,
)
from servopt.results import append_jsonl, parse_record, write_json_atomic
from servopt.runtimes.base import all_libraries
from servopt.settings import OptimizeSettings


def sweep_protocol(racing: bool = True) -> Protocol:
    """Short phases, so that a sweep of 25 variants fits in minutes; the contenders are re-measured side by side with
    longer phases before deciding. A race screens with shorter ones still: a variant far behind shows it in half a
    second, and one within the noise stays a contender."""
    if racing:
        return Protocol(min_runs=30, min_seconds=0.5, batch_min_runs=5, batch_min_seconds=0.5, warmup=5, cold_start=False)
    return Protocol(min_runs=50, min_seconds=1.0, batch_min_runs=8, batch_min_seconds=1.0, warmup=10, cold_start=False)


def reference_protocol(racing: bool = True) -> Protocol:
    """The original's timed phases in a race: its figures serve only the ratios of "before" and "after" (PyTorch eager
    is 5-10x the picks), so a few calls after its verification (which warms it) give them; the side-by-side rounds
    re-measure whatever is close. Its verification on the evaluation and tuning samples is the rest of its time. On an
    AVX2 Zen 3 twice as slow as a Zen 2, eager's 10 batch calls of the sweep's protocol took 58 s of a 5-minute demo."""
    base = sweep_protocol(racing)
    if not racing:
        return base
    # the batch phase shortened (its calls are the original's costly ones: seconds each for eager at batch 32 on a slow
    # machine); the single-sample phase kept (30 calls of tens of ms: ten left its p50's interval 18x wide under load)
    return base.model_copy(update={"batch_min_runs": 3, "batch_min_seconds": 0.0})


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


def lost(record: dict) -> bool:
    """A record of a job the cluster lost (its worker or node died): a rerun measures it again, as after a kill here."""
    return record.get("status") == "failed" and str(record.get("error") or "").startswith(LOST)


def _linear_heavy(model: LoadedModel) -> bool:
    if model.kind == "onnx":
        return is_linear_heavy(str(model.path))
    import torch

    mods = list(model.torch_module().modules())
    return sum(isinstance(m, torch.nn.Linear) for m in mods) > sum(isinstance(m, torch.nn.Conv2d) for m in mods)


@dataclass
class KindOutcome:
    """What the finish makes of one kind of node's records: its re-measures and its targets' decisions."""

    decisions: dict[str, Decision]
    interleaved: Interleaved | None
    capped: dict[str, Interleaved]
    pareto_front: list[str]
    scaling: Scaling | None = None


@dataclass
class Sweep(SweepBuilds, SweepRemeasures, SweepInstance):
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
    reused: list[str] = field(default_factory=list)  # figures an earlier run into this --out took (``Summary.reused``)
    late: dict[str, str] = field(default_factory=dict)  # variants whose build the time budget's end stopped, and why
    tuning_pending: Future | None = None  # the original's tuning judgement under way beside the first builds

    # ------------------------------------------------------------------------------------------------ context
    def __post_init__(self) -> None:
        self.dir = RunDir(self.settings.out)
        self.family: Family = family_of(self.model.spec)
        self.distributed = self.executor.distributed
        drop = min((t.max_accuracy_drop for t in self.targets), default=1.0)
        # a CPU target naming an ISA without 8-bit dot products (cpu-server: AVX2) gets dynamic INT8 weights it computes
        # right (7 bits), even where this machine has VNNI (decide also fails a model that would overflow there)
        poorer = any(t.device is Device.CPU and t.isa is not None and t.isa < Isa.AVX512_VNNI for t in self.targets)
        # the CPU the race ranks for: this one, or the poorest CPU target's view of it where that lacks VNNI — its INT8
        # must compute right there, and bf16/fp16 pay nothing there (the race puts both after what can win)
        poorest = min((t.isa for t in self.targets if t.device is Device.CPU and t.isa is not None), default=None)
        self.int8_cpu = capped_features(cpu_features(), poorest) if poorer and poorest is not None else cpu_features()
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
        self.budget = Budget(self.settings.budget_seconds, self.settings.budget, self.targets, self.family.name,
                             self.interleave_protocol, self.interleave_rounds,
                             axes=self.racing and bool(self.axes["grid"] or self.axes["length_batching"]),
                             capacity_probe=self.capacity_probe is not None, quick=self.settings.quick)

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

    def protocol_of(self, v: Variant) -> Protocol:
        """The protocol ``v`` is screened with: the original's is shorter in a race (``reference_protocol``), unless it
        is the baseline too (an ONNX source), whose figures every screening ratio is taken against."""
        if v.is_original and not v.is_baseline and self.racing and not self.settings.quick:
            return reference_protocol(self.racing)
        return self.protocol

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
        return self.budget.elapsed()

    def _contending(self) -> list[Record]:
        return [r for r in self.records.values()
                if r.status == "ok" and bool(r.phases) and r.name not in (self.original.name, self.baseline.name)]

    def contenders(self) -> int:
        """Variants measured so far that the finish could re-measure (the original and the baseline aside)."""
        return len(self._contending())

    def cappable(self) -> bool:
        """Whether one of them runs on a runtime a poorer target's instruction set can be imposed on (oneDNN, ATen):
        only then does the finish re-measure it capped."""
        return any(self.budget.cappable(r.runtime) for r in self._contending())

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
        with self.budget.stage("original"):
            self._measure_originals(todo)
        first = [u for u in todo if not u.variant.is_original and not (self.racing and u.variant.refines)]
        with self.budget.stage("screening"):
            if self.racing:  # the likely winners, their quality recovered, then the rest (what a budget drops first)
                likely, rest = racing.likely_first(first, self.family.name, cpu_features(), self.int8_cpu)
                self._screen(likely)
                self._tuning_collected()  # the ladder's "recovered?" reads the original's tuning judgement
                self._refine([u for u in todo if u.variant.refines and not u.variant.is_original])
                self._screen(rest)
            else:
                self._screen(racing.order(first, self.family.name, cpu_features(), self.int8_cpu))
            self._tuning_collected()  # where nothing was left to measure (a resumed run), the choices still read it
        with self.budget.stage("re-measure"):
            self._race_and_cold_start()

    def _prepare(self) -> None:
        self.dir.data.mkdir(parents=True, exist_ok=True)
        self.eval_data.save(self.dir.eval_data)
        data_hash = dataset_digest(self.dir.eval_data)
        if self.eval_data.outputs != "logits":  # how the judge reads the outputs (a Softmax model's confidence) is measured
            data_hash += f":{self.eval_data.outputs}"
        saved: dict[str, str | None] = {}
        for name, data in (("calib", self.calibration), ("tune", self.tuning)):  # for the build processes
            saved[name] = None
            if data is not None:
                data.save(self.dir.saved_data(name))
                saved[name] = str(self.dir.saved_data(name))
        self.start = source_artifact(self.model, build_data_key(saved["calib"], saved["tune"]))
        proto = self.protocol.model_dump()
        self.units = [Unit(v, k, unit_key(variant_key(v, str(self.start.hash), self.protocol_of(v).model_dump(), data_hash,
                                                  chain_data_key(self.start, v.chain),
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
                if u.variant.is_baseline:
                    self.budget.observe_baseline(rec)
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
        if u.variant.is_baseline:  # the first cost of this machine the finish is planned from
            self.budget.observe_baseline(rec)
        self.progress.advance()
        self.progress.result(rec)
        return rec

    def _update(self, u: Unit, rec: Record, fields: tuple[str, ...] = ("cold_start", "screened_out")) -> None:
        """A record completed after screening (its cold start, what screened it out, a pick's axes), kept in race.jsonl by
        key: results.jsonl keeps one line per measurement."""
        append_jsonl(self.dir.race, {"key": rec.key, **rec.model_dump(mode="json", include=set(fields))})
        self.records[(u.variant.name, u.kind)] = rec

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
        with self.budget.stage("re-measure"):
            if names:
                try:
                    interleaved = self.run_interleave(names, records, kind=kind)
                except UserError as e:
                    self.problems.append(f"{e.problem} — decided on the sweep's figures")
            if interleaved is not None:
                interleaved = self.run_alternating(names, records, interleaved, kind)
                interleaved = self.settle_ties(targets, records, reference, interleaved, kind)
            capped = self.run_capped(contenders, reference, kind, targets)
        with self.budget.stage("scaling"):
            scaling = self.run_scaling(targets, records, reference, interleaved, capped, kind)

        def decided(t: Target, capacities: list[Capacity] | None = None) -> Decision:
            return decide(t, records, reference, self.family, capped.get(t.isa or "") or interleaved, scaling, capacities)

        with self.budget.stage("capacity"):
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
            with self.budget.stage("re-measure"):
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
            budget=self.budget.plan(self.contenders(), self.cappable()),
            reused=self.reused, load_ips=self.settings.load_ips, interrupted=interrupted)
        write_json_atomic(self.dir.summary, summary)
        if interrupted:  # no profile, no history: a stopped run measures nothing more and teaches nothing
            return summary

        def profile(kind: str | None) -> None:
            picks = [d.pick for d in (decisions[t.name] for t in self.targets_of(kind))]
            self.profile_variants([p for p in picks if p], of_kind[kind], kind)

        with self.budget.stage("closing"):
            self._per_kind(profile, self.kinds)
            racing.remember(self.family.name, cpu_features(), records, self.baseline.name, self.budget.spent)
        summary = summary.model_copy(update={"budget": self.budget.plan(self.contenders(), self.cappable())})  # with the profiles' time
        write_json_atomic(self.dir.summary, summary)
        return summary
