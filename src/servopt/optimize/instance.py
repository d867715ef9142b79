"""The target's instance, for one sweep: the candidates' scaling with cores (``bench.scaling``) and each priced
target's pick served and its capacity within the SLO searched (``Sweep.capacity_probe``). ``Sweep`` mixes it in."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from servopt.bench.launcher import Interrupted, stopping
from servopt.bench.scaling import ScalingJob
from servopt.contracts import Capacity, Interleaved, Record, Scaling, ServedData
from servopt.cpu import Isa, richer
from servopt.machine import cpu_features
from servopt.optimize import racing
from servopt.optimize.candidates import interleave_candidates
from servopt.optimize.decide import Decision
from servopt.optimize.executor import Lost
from servopt.optimize.remeasure import _joining, _one_process
from servopt.optimize.rundir import stored
from servopt.optimize.targets import Target
from servopt.results import write_json_atomic
from servopt.runtimes.base import INSTANCE_THREADING, get_runtime

if TYPE_CHECKING:
    from servopt.spec import ModelSpec


def instance_sample_ms(rec: Record) -> float | None:
    """One serving instance's time a sample in a batch (what the capacity search's batch bound is sized from): the
    machine's batch loop spread over one single-thread instance per core, as servopt serve lays a throughput target out."""
    env = rec.environment
    cores = (env.cores_usable or env.cores) if env else None
    return 1000.0 * cores / rec.batch_ips if cores and rec.batch_ips else None


def server_cap(target: Target, rec: Record) -> dict[str, str] | None:
    """The instruction-set cap ``rec``'s server runs under for ``target``: the one its scaling curve was held to
    (``run_scaling``: the target's rung, where this machine is richer and the runtime can be held), so the share of
    its offline figure a served capacity kept is like with like, and the capacity priced is the target's CPU's."""
    if target.isa is None or not richer(cpu_features().level, target.isa):
        return None
    return get_runtime(rec.runtime).isa_cap_env(Isa(target.isa))


def served_data(spec: ModelSpec | None, eval_data: Path, images: list[str], requests: str | None) -> ServedData:
    """What a capacity search sends: the user's evaluation data, as a target's clients send it (``requests``: its
    ``requests``; ``images``: the evaluation data's files) (issue 42)."""
    tokenizer = (spec.preprocessing or {}).get("tokenizer") if spec else None
    return ServedData(eval_data=str(eval_data), tokenizer=str(tokenizer) if tokenizer else None,
                      images=images if requests == "images" else [])


def run_served_data(run_dir: Path, target: str) -> ServedData:
    """What a finished run's capacity search for ``target`` sent, read back from the run directory: for the
    independent checks (``benchmarks/capacity_check.py``, ``capacity_repeat.py``)."""
    from servopt.data.dataset import Dataset
    from servopt.optimize.rundir import RunDir, load_config

    config = load_config(run_dir)
    requests = next((t.requests for t in (config.targets if config else []) if t.name == target), None)
    eval_data = RunDir(run_dir).eval_data
    images = (Dataset.load(eval_data).files or []) if requests == "images" else []
    return served_data(config.spec if config else None, eval_data, images, requests)


class SweepInstance:
    """Scaling and served capacity (a mixin of ``Sweep``)."""

    def instance_targets(self, targets: list[Target]) -> list[Target]:
        """The targets naming an instance whose figures this machine (or this kind's nodes) can take: a CPU's."""
        return [t for t in targets if t.names_instance]

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
        cache_key = json.dumps([sorted(str(by_name[n].key) for n in names), rounds, seconds, isa, INSTANCE_THREADING])
        path = self.dir.scaling(kind)
        if (previous := stored(path, Scaling.model_validate, {cache_key})) is not None:
            return previous
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
            if not t.served or self.capacity_probe is None:
                continue
            found: list[Capacity] = []
            for _ in range(racing.CAPACITY_PICKS):
                d = decided(t, found)
                pick = d.pick
                if pick not in by_name or any(c.variant == pick for c in found):
                    break
                capacity = self._capacity_of(t, by_name[pick], kind)
                if capacity is None:
                    if found:
                        self.problems.append(f"{t.name}: {pick} became the pick once {found[-1].variant}'s served capacity "
                                             f"missed, but was not served itself: judged on its offline figures × the share "
                                             "of them the served variants kept")
                    break
                found.append(capacity)
            else:  # the served figures moved the pick every time: the last pick is judged on offline figures, say so
                last = decided(t, found)
                pick = last.pick
                if found and pick not in {c.variant for c in found}:
                    self.problems.append(
                        f"{t.name}: {pick} became the pick after {', '.join(c.variant for c in found)} were served and their "
                        f"capacity judged; it was not served itself (at most {racing.CAPACITY_PICKS} picks are): judged on its "
                        "offline figures × the share of them the served variants kept (an estimate: its own serving was not "
                        "measured)")
            if found:
                out[t.name] = found
        return out

    def served_data(self, t: Target) -> ServedData:
        """What the capacity search of ``t``'s pick sends (``served_data``)."""
        return served_data(self.model.spec, self.dir.eval_data, self.eval_data.files or [], t.requests)

    def _capacity_of(self, t: Target, rec: Record, kind: str | None) -> Capacity | None:
        """One variant's capacity within ``t``'s SLO (cached), or None with the reason in ``problems``."""
        pick = rec.name
        if not get_runtime(rec.runtime).servable:
            self.problems.append(f"{t.name}: {pick} runs on {rec.runtime}, which servopt serve does not run: priced offline")
            return None
        quick = self.settings.quick
        cache_key = json.dumps([rec.key, t.max_p99_ms, quick, racing.CAPACITY_METHOD, INSTANCE_THREADING, t.requests,
                                server_cap(t, rec)])
        path = self.dir.capacity(t.name, pick)
        if (previous := stored(path, lambda d: Capacity.model_validate(d["capacity"]), {cache_key})) is not None:
            return previous
        seconds = racing.CAPACITY_SECONDS if not quick else 15.0
        budget_bound = False
        if (left := self.budget.left()) is not None:
            budget_bound = left < seconds
            seconds = min(seconds, left)
            if seconds < racing.CAPACITY_MIN_SECONDS and not quick:
                self.budget.skip("capacity", f"serving {pick}")
                self.problems.append(f"{t.name}: the time budget ({self.settings.budget}) left no time to serve {pick} and "
                                     "search its capacity within the SLO: priced on the offline figures")
                return None
        # half the offline rate, at most 200/s: a served request costs the HTTP front end and the load generator (on
        # the same cores) far more than a tiny model's call, and the search doubles from there in a few steps
        start = min(200.0, max(1.0, 0.5 * (rec.batch_ips or rec.throughput_ips or 20.0)))
        per_sample = instance_sample_ms(rec)
        self.progress.step(f"serving {pick}: its capacity within p99 <= {t.max_p99_ms:g} ms{self._for(kind)}")
        try:
            capacity = self.executor.submit(self.capacity_probe, self.out, pick, 99, t.max_p99_ms, start, seconds, quick,
                                            per_sample, self.served_data(t), server_cap(t, rec), resources=self.kinds.get(kind),
                                            what=f"capacity {pick}").result()
            if stopping():  # its servers were stopped mid-search: not a capacity to keep
                raise Interrupted(f"the capacity search of {pick} was stopped")
        except Lost as e:
            self.problems.append(f"{t.name}: the capacity search of {pick} was lost: {e}")
            return None
        if capacity.error:
            self.problems.append(f"{t.name}: the capacity search of {pick} failed: {capacity.error} — priced on the offline figures")
            return None
        if capacity.timed_out:  # kept for reading (its steps), never reused: a rerun with more time searches it
            write_json_atomic(path, {"cache_key": None, "capacity": capacity.model_dump(mode="json")})
            why = ("the time the budget left it", "rerun with a larger --budget") if budget_bound else (
                f"its {seconds:.0f} s", "the model's steps and confirming runs are long on this machine; rerun, or serve it "
                "and run servopt loadtest --slo")
            self.problems.append(f"{t.name}: the capacity search of {pick} ran out of {why[0]} before a rate was confirmed — "
                                 f"priced on the offline figures ({why[1]})")
            return None
        write_json_atomic(path, {"cache_key": cache_key, "capacity": capacity.model_dump(mode="json")})
        return capacity
