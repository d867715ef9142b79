"""The side-by-side re-measures of one sweep: the race's screen-out and cold starts, the contenders interleaved in one
process (capped to a target's poorer ISA where a runtime can be), the alternating re-measure of runtimes in an
environment of their own, the duels that settle close calls, the picks' axes and profiles. Each is cached in the run
directory by what it measured, so a resumed run measures nothing twice. ``Sweep`` mixes it in."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, as_completed
from pathlib import Path
from typing import TYPE_CHECKING

from servopt.bench.alternate import AlternationFailed, alternate
from servopt.bench.jobs import ColdStartJob, DuelJob, InterleaveJob, MeasureJob, OpenSpec, ProfileJob
from servopt.bench.launcher import OutOfTime, launch
from servopt.bench.protocol import Protocol
from servopt.bench.rounds import side_by_side
from servopt.contracts import ColdStart, Interleaved, OpProfile, Record, SideBySide
from servopt.cpu import richer
from servopt.errors import UserError
from servopt.machine import Device, cpu_features
from servopt.optimize import noise, racing
from servopt.optimize.candidates import interleave_candidates, unsettled
from servopt.optimize.decide import Decision
from servopt.optimize.executor import Lost
from servopt.optimize.rundir import load_profile, stored
from servopt.optimize.targets import Target
from servopt.results import write_json_atomic
from servopt.runtimes.base import get_runtime

if TYPE_CHECKING:
    from servopt.optimize.builds import Unit


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
    sessions = [OpenSpec.of(by_name[n])
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


def _interleaved(data: dict) -> Interleaved:
    """An interleaved re-measure as stored (an older servopt's files also held its protocol)."""
    return Interleaved.model_validate({k: v for k, v in data.items() if k != "protocol"})


def _stored_interleaved(path: Path) -> Interleaved | None:
    """The interleaved re-measure stored at ``path``, whatever it measured (the duels are written back into it)."""
    try:
        return _interleaved(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def cold_start(job: ColdStartJob, workdir: Path, deadline: float | None = None) -> ColdStart:
    """Imports + load + first answer, timed from outside the job's process, with its peak memory."""
    try:
        started = launch(job, workdir, None, deadline)
    except OutOfTime as e:
        return ColdStart(error=f"not measured: {e}")
    return started.result.model_copy(update={"total_s": started.ready_s}) if started.result is not None else ColdStart(error=started.error)


class SweepRemeasures:
    """Re-measures, duels, cold starts and profiles (a mixin of ``Sweep``)."""

    def _out_of_time(self, what: str, e: Exception) -> None:
        self.problems.append(f"{what}: stopped at the time budget's end (--budget {self.settings.budget}; {e}); rerun with a "
                             "larger --budget to finish it (finished work is kept)")

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
            launched = self.executor.submit(launch, job, self.dir.work_root / label, None, self.budget.finish_deadline(),
                                            resources=self.kinds.get(kind), what=label).result()
        except Lost:
            return {}
        except OutOfTime as e:
            self._out_of_time(f"the side-by-side run of {', '.join(names)}", e)
            return {}
        return dict(launched.result.variants) if launched.result is not None else {}

    def _race_and_cold_start(self) -> None:
        """Screen out, per kind of node, what is beaten beyond noise for every target; cold-start the contenders."""
        pending: dict[Future, tuple[Unit, Record]] = {}
        by_unit = {(u.variant.name, u.kind): u for u in self.units}
        for kind in self.kinds:
            records = [r for (n, k), r in self.records.items() if k == kind]
            reference = self.references.get(kind) or next(iter(self.references.values()))
            keep = {self.original.name, self.baseline.name}
            # The original and the baseline are never marked screened out (every figure is compared with them: their cold
            # starts too), but an original beaten beyond noise is no contender: it gets no side-by-side re-measure, and
            # under a time budget no cold start either (PyTorch's import and load: seconds a slow machine's budget lacks)
            cold_too = {self.baseline.name} | ({self.original.name} if self.budget.seconds is None else set())
            beaten = racing.screened_out(self.targets_of(kind) or self.targets, records, reference, self.family, set()) \
                if self.racing else {}
            self.beaten[kind] = set(beaten) - {self.baseline.name}
            for rec in records:
                u = by_unit.get((rec.name, kind))
                if u is None or rec.status != "ok":
                    continue
                if rec.name in beaten and rec.name not in keep and rec.screened_out is None and rec.cold_start is None:
                    self._update(u, rec.model_copy(update={"screened_out": beaten[rec.name]}))
                elif rec.name in beaten and rec.name not in cold_too and rec.cold_start is None:
                    self.budget.skip("re-measure", f"the cold start of {rec.name} (beaten beyond noise)")
                elif (rec.name not in beaten or rec.name in cold_too) and rec.cold_start is None and rec.artifact is not None:
                    job = ColdStartJob(session=OpenSpec.of(rec),
                                       spec=self.model.spec, env=rec.env)
                    self.progress.step(f"cold start of {rec.name}{self._for(kind)}")
                    future = self.executor.submit(cold_start, job, self.dir.work(rec.name, kind) / "coldstart", self.budget.finish_deadline(),
                                                  resources=self.kinds[kind], what=f"cold start {rec.name}{self._for(kind)}")
                    pending[future] = (u, rec)
        for future in as_completed(pending):
            u, rec = pending[future]
            try:
                cold = future.result()
            except Lost as e:
                cold = ColdStart(error=str(e))
            self._update(u, rec.model_copy(update={"cold_start": cold, "screened_out": None}))

    def _axes_of_picks(self, decisions: dict[str, Decision]) -> None:
        """A racing sweep measured no variant's own axes (a text encoder's grid, its real texts by batching order): the
        picks (and the baseline, to compare with) get them now, each in its own process, alone on the machine."""
        axes = self.axes
        if not self.racing or not (axes["grid"] or axes["length_batching"]):
            return
        by_unit = {(u.variant.name, u.kind): u for u in self.units}
        wanted = [(d.pick, d.result.measured_for if d.result else None) for d in decisions.values()]
        wanted += [(self.baseline.name, k) for k in self.kinds]
        for name, kind in dict.fromkeys(w for w in wanted if w[0]):
            rec, u = self.records.get((name, kind)), by_unit.get((name, kind))
            if rec is None or u is None or rec.status != "ok" or rec.artifact is None or rec.grid or rec.length_batching:
                continue
            proto = self.protocol.model_copy(update={**axes, "axes_only": True})
            job = MeasureJob(session=OpenSpec.of(rec),
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
            launched = self.executor.submit(launch, job, folder, None, self.budget.finish_deadline(), resources=self.kinds.get(kind),
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

        # a budget may have cut its rounds short: still the same measurement
        previous = stored(path, _interleaved, {key(r) for r in range(2, self.interleave_rounds + 1)})
        if previous is not None:
            self.reused.append(f"side-by-side re-measure {label}" + (f" and its {len(previous.duels)} duel(s)" if previous.duels else ""))
            return previous
        rounds = self.interleave_rounds
        if (deadline := self.budget.finish_deadline()) is not None:  # rounds that fit what the budget leaves, sized by the calls
            per_round = sum(racing.remeasure_seconds(by_name[n], self.interleave_protocol) + 2.0 for n in names)
            # the scaling's reserve kept too (the capacity search's and the closing's are outside the deadline already)
            fit = int((deadline - time.time() - self.budget.scaling_reserve(len(names))) // per_round)
            if fit < 2:
                self.budget.skip("re-measure", f"the side-by-side re-measure {label}")
                self.problems.append(f"the side-by-side re-measure {label} was not run: a round of {len(names)} variants takes "
                                     f"about {per_round:.0f} s and the time budget ({self.settings.budget}) leaves less than "
                                     "two; decided on the screening figures (rerun with a larger --budget)")
                return None
            rounds = min(rounds, fit)
        cache_key = key(rounds)
        job = self._interleave_job(names, by_name, baseline, self.interleave_protocol, rounds, caps)
        try:
            launched = self.executor.submit(launch, job, self.dir.work_root / label, None, self.budget.finish_deadline(),
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
        cached = stored(path, lambda d: {n: SideBySide.model_validate(v) for n, v in d["variants"].items()}, {cache_key})
        if cached is not None:
            alternated = cached
            self.reused.append(f"alternating re-measure of {', '.join(own)}{self._for(kind)}")
        else:
            jobs = {n: MeasureJob(session=OpenSpec.of(by_name[n]), data=str(self.dir.eval_data),
                                  family=self.model.spec.family_name, protocol=self.interleave_protocol.model_copy(
                                      update={"cold_start": False, "grid": [], "length_batching": False}), env=by_name[n].env)
                    for n in [self.baseline.name, *own]}
            self.progress.step(f"re-measuring {', '.join(own)} process by process with the baseline")
            try:
                future = self.executor.submit(alternate, jobs, self.interleave_rounds, self.dir.work("alternating", kind),
                                              self.budget.finish_deadline(),
                                              resources=self.kinds.get(kind), what="alternating re-measure")
                alternated = side_by_side(future.result(), self.baseline.name, anchor, method="alternating")
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

    def settle_ties(self, targets: list[Target], records: list[Record], reference: Record | None, interleaved: Interleaved,
                    kind: str | None) -> Interleaved:
        """The close calls the interleaved rounds leave (the rounds are seconds apart, and a round moves a figure by
        more than the gaps that matter): each CPU or edge target's pick and up to ``racing.DUEL_RIVALS`` rivals
        (``candidates.unsettled``: tied with it, or within the drift) take turns block by block in one process
        (``bench.duel``) on the target's speed figures; the duels' verdicts replace the rounds' for the pairs they
        cover (``decide.surely_ahead``). Stored with the rounds, with how many duel jobs ran (a resumed run measures
        nothing the first run settled or stopped at); under a time budget, only in the time it leaves."""
        by_name = {r.name: r for r in records if r.status == "ok" and r.artifact is not None}
        while interleaved.settle_rounds < racing.DUEL_SETTLE_ROUNDS:
            names, asked = unsettled(targets, records, reference, self.family, interleaved, racing.DUEL_RIVALS)
            if interleaved.covers(names, asked):
                break
            seconds = self.budget.duel_seconds(len(asked))
            if seconds is None:
                self.budget.skip("re-measure", f"the duel of {', '.join(names)}")
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
        here = env.isa if self.distributed and env else cpu_features().level
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

    def profile_variants(self, names: list[str], records: list[Record], kind: str | None = None) -> None:
        """Op-level profiles of the recommended variants, each in its own process (a measurement, so not in the report
        step: ``servopt report`` only reads), cached; a failed profile is stored with its reason."""
        by_name = {r.name: r for r in records}
        for name in dict.fromkeys(names):
            rec = by_name.get(name)
            if rec is None or rec.artifact is None or load_profile(self.out, name, kind) is not None:
                continue
            self.progress.step(f"profiling {name}{self._for(kind)}")
            job = ProfileJob(session=OpenSpec.of(rec),
                             data=str(self.dir.eval_data), env=rec.env)
            try:
                launched = self.executor.submit(launch, job, self.dir.work(name, kind) / "profile", None,
                                                self.budget.finish_deadline("closing"), resources=self.kinds.get(kind),
                                                what=f"profile {name}").result()
                prof = launched.result or OpProfile(variant=name, profiler="none", total_ms_per_run=0.0, error=launched.error)
            except Lost as e:
                prof = OpProfile(variant=name, profiler="none", total_ms_per_run=0.0, error=str(e))
            except OutOfTime as e:  # not stored: a rerun with more time profiles it
                self._out_of_time(f"the profile of {name}", e)
                continue
            write_json_atomic(self.dir.profile(name, kind), prof)
