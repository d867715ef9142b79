"""Builds and screening of one sweep: the chains built (two at a time here, a pass that times itself alone; each
chain prefix once), every variant verified and screened in its own process, in rounds the budget admits, and the
refinement ladder that builds a quality-recovering variant only where its base misses a bound. ``Sweep`` mixes it in."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, as_completed
from dataclasses import dataclass
from pathlib import Path

from servopt.bench.jobs import MeasureJob, OpenSpec
from servopt.bench.launcher import OutOfTime, launch
from servopt.bench.run import measure
from servopt.contracts import ChainStep, Gate, Quality, Record
from servopt.errors import UserError
from servopt.machine import Device, cpu_features, gpu_present
from servopt.optimize import racing
from servopt.optimize.executor import LOST, Lost
from servopt.optimize.rundir import LeftOut
from servopt.optimize.variants import Variant
from servopt.passes.base import (
    cached_artifact,
    get_pass,
)
from servopt.passes.build_job import BuildJob
from servopt.runtimes.base import get_runtime

BUILD_ROUND = 4  # variants built together (two at a time here) before they are screened one by one


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


def _ident(chain: list[tuple[str, dict]]) -> str:
    return json.dumps(chain, sort_keys=True, default=str)


@dataclass
class Unit:
    """One measurement to make: a variant, for a kind of node (None: this machine, for every target)."""

    variant: Variant
    kind: str | None
    key: str


class SweepBuilds:
    """Build, verify and screen (a mixin of ``Sweep``)."""

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
                futures[key] = self.executor.submit(launch, job, folder, None, self.budget.deadline(v), what=what, exclusive=alone)
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

    def _gate(self, reference: Quality | None) -> Gate:
        """The verification gate of the settings, against the original's ``reference`` quality."""
        s = self.settings
        return Gate(reference=reference, max_drop_points=s.verify_max_drop, min_agreement=s.verify_min_agreement,
                    min_cosine=s.verify_min_cosine)

    def _tuning_gate(self, reference: Record | None) -> Gate | None:
        """The verification gate as the tuning samples judge it (a choice reads only them)."""
        return None if reference is None or reference.tuning_quality is None else self._gate(reference.tuning_quality)

    def _measure_job(self, u: Unit, artifact, reference: Record | None, ref_outputs: Path) -> MeasureJob:
        """The measurement of a variant; the original's (``reference`` None) saves the outputs the others are verified against."""
        v = u.variant
        gate = None if reference is None or not v.gate else self._gate(reference.quality)
        # The tuning samples judged too where the refinement ladder reads them: a refined variant, a refinement, and the
        # original on a cluster (on one machine its judgement there runs beside the first builds: ``_judge_original_on_tuning``)
        if reference is None:
            tuned = self.ctx.tuning_path if self.distributed else None
        else:
            tuned = self.ctx.tuning_path if v.refines or any(c.refines == v.name for c in self.all_variants) else None
        ref_tuning = _tuning_outputs(ref_outputs)
        return MeasureJob(session=OpenSpec(name=v.name, artifact=artifact, runtime=v.runtime, options=v.options),
                          data=str(self.dir.eval_data), family=self.model.spec.family_name,
                          reference=None if reference is None else str(ref_outputs),
                          save_outputs=str(ref_outputs) if reference is None else None, protocol=self.protocol_of(v), gate=gate, env=v.env,
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
                self.budget.charge(name, own.get(name, 0.0) + rest / len(units))

    def _build_and_measure(self, units: list[Unit], own: dict[str, float]) -> None:
        available = {u.variant.name: runtime_available(u.variant.runtime) for u in units}
        to_build = list({u.variant.name: u.variant for u in units if available[u.variant.name][0] or self.distributed}.values())
        built = self._build(to_build) if to_build else {}
        self._tuning_collected()  # before anything is measured against the original's tuning outputs
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
                                          self.budget.deadline(u.variant), resources=self.kinds[u.kind], what=f"measure {u.variant.name}{self._for(u.kind)}")
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

    def _not_finished(self, u: Unit, why: str) -> None:
        """A job the time budget's end stopped: listed as not tried, no record (a rerun with more time tries it)."""
        self.not_tried.append(LeftOut(name=u.variant.name, why=f"not finished: {why} (--budget {self.settings.budget}): rerun "
                                      "with a larger --budget (finished variants are kept)"))
        self.budget.skip("screening", f"{u.variant.name} (not finished)")
        self.progress.note(f"{u.variant.name}{self._for(u.kind)}: not finished, {why}")

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
        self._judge_original_on_tuning()

    def _judge_original_on_tuning(self) -> None:
        """On one machine, the original's outputs on the tuning samples (what every refined variant is judged against
        there, and its own ``tuning_quality`` the race's choices read) in a job of its own, beside the first builds:
        nothing is timed meanwhile, and a PyTorch original spent a third of its measurement on them (25 s of 76 with
        a busy process on each core). Collected before anything else is measured (``_tuning_collected``)."""
        rec = self.references.get(None)
        if self.distributed or rec is None or self.ctx.tuning_path is None or rec.tuning_quality is not None:
            return
        v = self.original
        job = MeasureJob(session=OpenSpec.of(rec),
                         data=str(self.dir.eval_data), family=self.model.spec.family_name, protocol=self.protocol_of(v),
                         env=v.env, tuning_data=self.ctx.tuning_path, tuning_only=True,
                         save_tuning_outputs=str(_tuning_outputs(self.dir.reference_outputs(None))))
        self.progress.step(f"judging {v.name} on the tuning samples (beside the first builds)")
        self.tuning_pending = self.executor.submit(launch, job, self.dir.work(v.name) / "tuning", None, None,
                                                    what=f"{v.name} on the tuning samples", exclusive=False)

    def _tuning_collected(self) -> None:
        """The original's tuning judgement, once it is back, in its record (and race.jsonl, for a resume)."""
        future, self.tuning_pending = self.tuning_pending, None
        if future is None:
            return
        try:
            done = future.result()
        except Lost as e:
            done = None
            error = str(e)
        else:
            error = done.error
        if done is None or done.result is None:
            raise UserError(f"the original model could not be judged on the tuning samples: {error}",
                            fix="check the model and data, then rerun (what was finished is kept)")
        rec = self.references[None].model_copy(update={"tuning_quality": done.result.tuning_quality})
        self.references[None] = rec
        unit = next(u for u in self.units if u.variant.is_original and u.kind is None)
        self._update(unit, rec, fields=("tuning_quality",))

    def _screen(self, units: list[Unit]) -> None:
        """Build and screen ``units`` in rounds (a cluster: all at once), within the time budget."""
        size = max(1, len(units)) if self.distributed else BUILD_ROUND
        i = 0
        while i < len(units):
            fit = self.budget.fits(units[i:i + size], self.contenders(), self.original.name, self.cappable())
            if fit == 0 and units[i].variant.is_baseline:
                fit = 1  # the baseline alone, whatever the budget: every ratio, the race and the report compare with it
            if fit == 0:  # this one does not fit what is left; a cheaper one further down the order may
                self.not_tried.append(LeftOut(name=units[i].variant.name, why=f"the time budget ({self.settings.budget}) ran "
                                              f"out after {self.elapsed():.0f} s: rerun with a larger --budget (finished variants are kept)"))
                self.budget.skip("screening", units[i].variant.name)
                i += 1
                continue
            self._measure(units[i:i + fit])
            i += fit

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
        for (base, kind), group in racing.refinement_groups(units, self.family.name, cpu_features(), self.int8_cpu):
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
                gate = self._tuning_gate(ref)
                gaps = [self.family.gate_shortfall(r.tuning_quality, gate) if gate and r is not None and r.tuning_quality
                        else None for r in measured]
                search = sum(get_pass(name).slow_seconds for name, _ in u.variant.chain)  # a search: minutes, not seconds
                search *= racing.search_scale(self.budget.batch_call_seconds())
                if search and (hopeless := racing.refinement_hopeless(drops, tolerance, len(tried), gaps)):
                    self.not_tried.append(LeftOut(name=u.variant.name, why=f"not built (a search of about {search:.0f} s): {hopeless}"))
                    continue
                self._screen([u])
                tried.append(u.variant.name)
                if u.variant.same_kernels and not self._misses_quality(self.records.get((u.variant.name, kind)), kind):
                    recovered = u.variant.name


def _tuning_outputs(ref_outputs: Path) -> Path:
    """Where the original's outputs on the tuning samples are kept, beside its outputs on the evaluation samples."""
    return ref_outputs.with_name(f"{ref_outputs.stem}-tuning.npy")
