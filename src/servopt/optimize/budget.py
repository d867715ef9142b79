"""The time budget's arithmetic of one sweep, in one place: when a build or measurement must end, when the finish's
jobs must, how many variants still fit with room for the finish (its re-measures sized by the model's measured calls),
how long a duel may take, what the instance's answer reserves. ``Sweep`` mixes it in; it reads the sweep's state."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from servopt.contracts import Record
from servopt.machine import Device, cpu_features, gpu_present, richer
from servopt.optimize import racing
from servopt.optimize.rundir import LeftOut
from servopt.optimize.variants import Variant

if TYPE_CHECKING:
    from servopt.optimize.builds import Unit


class SweepBudget:
    """``--budget``: deadlines and what fits (a mixin of ``Sweep``)."""

    def left(self, closing: bool = True) -> float | None:
        """Seconds the budget leaves now, less the profiles and the report (``closing``); None without a budget. Every
        deadline and allowance of the finish is made from it."""
        budget = self.settings.budget_seconds
        if budget is None:
            return None
        return budget - self.elapsed() - (racing.closing_seconds(len(self.targets)) if closing else 0.0)

    def deadline(self, v: Variant) -> float | None:
        """When a job of ``v`` must end (``time.time()``): the time budget's end, less the finish's profiles and report;
        None without a budget, and for the original and the baseline (measured whatever the budget)."""
        left = self.left()
        return None if left is None or v.is_original or v.is_baseline else time.time() + left

    def finish_deadline(self, closing: bool = True) -> float | None:
        """When a job of the sweep's finish (a re-measure, a duel, the scaling, a cold start, a pick's axes) must end:
        the budget's end less the profiles and the report (``closing``), or the budget's end itself (a profile). Their
        time is planned (``racing.finish_estimate``), but a model's call time can outgrow any plan (MPNet's side-by-side
        re-measure took 2 min of a 10-minute budget): the deadline is what makes the budget bind. None without one."""
        left = self.left(closing)
        return None if left is None else time.time() + left

    def _out_of_time(self, what: str, e: Exception) -> None:
        self.problems.append(f"{what}: stopped at the time budget's end (--budget {self.settings.budget}; {e}); rerun with a "
                             "larger --budget to finish it (finished work is kept)")

    def _not_finished(self, u: Unit, why: str) -> None:
        """A job the time budget's end stopped: listed as not tried, no record (a rerun with more time tries it)."""
        self.not_tried.append(LeftOut(name=u.variant.name, why=f"not finished: {why} (--budget {self.settings.budget}): rerun "
                                      "with a larger --budget (finished variants are kept)"))
        self.progress.note(f"{u.variant.name}{self._for(u.kind)}: not finished, {why}")

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
        level = cpu_features().level  # a CPU target naming a poorer ISA gets a capped re-measure of its own
        capped = len({t.isa for t in here if t.device is Device.CPU and t.isa is not None and richer(level, t.isa)})
        scale, turn = racing.search_scale(self.batch_call_seconds()), self.remeasure_turn()  # the baseline's, once
        total = 0.0
        for count, u in enumerate(units, 1):
            total += racing.expected_seconds(u.variant, learned, average, scale)
            reserve = racing.finish_estimate(self.interleave_rounds, len(here), contenders + count, axes, remeasured,
                                             turn, capped)
            reserve += self.instance_reserve(contenders + count)
            if self.elapsed() + total + reserve > budget:
                return count - 1
        return len(units)

    def duel_seconds(self, figures: int) -> float | None:
        """How long a duel may take per figure: ``racing.DUEL_SECONDS_PER_FIGURE``, or what the time budget leaves after
        loading the duel and the finish (profiles, the report), split between its figures; None when that is under
        ``racing.DUEL_MIN_SECONDS``."""
        most = 0.5 if self.settings.quick else racing.DUEL_SECONDS_PER_FIGURE
        now = self.left()
        if now is None:
            return most
        # the instance's answer (scaling, the capacity search) comes after the duel: its time is kept for it
        left = (now - racing.DUEL_LOAD_SECONDS - self.instance_reserve(3)) / max(1, figures)
        return min(most, left) if left >= min(most, racing.DUEL_MIN_SECONDS) else None

    def instance_reserve(self, contenders: int, capacity: bool = True) -> float:
        """Seconds the instance's answer takes at the end (``racing.instance_seconds``): the scaling of up to three
        candidates and the baseline per target naming an instance, and (``capacity``) a capacity search per priced one
        with an SLO — which the side-by-side re-measures do not keep for it: the pick must be right before its capacity
        is searched, and the search takes what is left (at least ``racing.CAPACITY_MIN_SECONDS``, else offline)."""
        mine = self.instance_targets(self.targets)
        if not mine:
            return 0.0
        from servopt.bench.scaling import machine_cores

        candidates = min(contenders, 3 * len(mine)) + 1
        priced = sum(t.price_per_hour is not None and t.max_p99_ms is not None for t in mine) if self.capacity_probe and capacity else 0
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
