"""The time budget of one sweep (``--budget``): one object the sweep's parts take explicitly, which plans the stages
from what this run has measured of this machine and says afterwards what each stage used and what it skipped.

A budget that fits a fast VNNI Xeon spent itself on an AVX2 Zen 3 twice as slow as a Zen 2 measuring the original and
variants already beaten, and priced nothing (issue 40). So it is planned from this run's own costs — the baseline's
batch call (a side-by-side turn, a scaling point, a search's scale), the variants' build and screening seconds as they
come (an earlier run's on this CPU before that) —, and the finish is reserved from the start, the capacity search first
among it: every stage before the capacity search must end early enough to leave it ``racing.CAPACITY_RESERVE_SECONDS``
and the report its closing seconds (``deadline``). What each stage used is timed (``stage``), and the plan with its
use goes into summary.json and the report (``BudgetPlan``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from servopt.bench.protocol import Protocol
from servopt.contracts import BudgetPlan, BudgetStage, Record
from servopt.cpu import richer
from servopt.machine import Device, cpu_features, gpu_present
from servopt.optimize import racing
from servopt.optimize.targets import Target
from servopt.optimize.variants import Variant
from servopt.runtimes.base import get_runtime

# The stages of a sweep, in the order they run: a stage's jobs must end early enough to leave every later stage's
# reserve (``Budget.deadline``). The original and the baseline are measured whatever the budget.
STAGES = ("original", "screening", "re-measure", "scaling", "capacity", "closing")
FIRST_UNIT_SECONDS = 15.0  # a variant's build and screening before this run or an earlier one on this CPU timed any


@dataclass
class Budget:
    """Deadlines and what fits, for one sweep. ``seconds`` None: no budget (every deadline None, everything fits)."""

    seconds: float | None
    label: str | None  # as the user wrote it (--budget 5m), for the messages
    targets: list[Target]
    family: str
    protocol: Protocol  # the side-by-side re-measure's (its turns are what the finish reserves)
    rounds: int  # side-by-side rounds
    axes: bool  # a racing sweep measures the picks' own axes at the end (a text encoder's grid)
    capacity_probe: bool  # the commands layer handed a capacity search: priced targets with an SLO are served
    quick: bool = False
    started: float = field(default_factory=time.monotonic)
    spent: dict[str, float] = field(default_factory=dict)  # seconds each variant took to build and screen
    baseline: Record | None = None  # the baseline's screening record: its calls size the finish
    used: dict[str, float] = field(default_factory=dict)  # seconds each stage took
    skipped: dict[str, list[str]] = field(default_factory=dict)  # per stage, what it left out for the time

    # ------------------------------------------------------------------------------------------------ observing
    def observe_baseline(self, rec: Record | None) -> None:
        """The baseline's screening record: the first cost of this machine the finish is planned from."""
        if rec is not None and rec.status == "ok":
            self.baseline = rec

    def charge(self, name: str, seconds: float) -> None:
        """``seconds`` more of building and screening ``name`` (what the next runs on this CPU plan with too)."""
        self.spent[name] = self.spent.get(name, 0.0) + seconds

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Times a stage of the sweep (summed over its parts: a kind of node's, a pick's)."""
        began = time.monotonic()
        try:
            yield
        finally:
            self.used[name] = self.used.get(name, 0.0) + time.monotonic() - began

    def skip(self, stage: str, what: str) -> None:
        """Something ``stage`` left out for the time (the report lists it under the plan)."""
        self.skipped.setdefault(stage, []).append(what)

    # ------------------------------------------------------------------------------------------------ the machine's costs
    def batch_call_seconds(self) -> float:
        """One batch call of the baseline on all cores (0 before it is measured)."""
        tp = self.baseline.throughput_ips.batch if self.baseline is not None and self.baseline.throughput_ips else None
        return self.protocol.batch_size / tp if tp else 0.0

    def remeasure_turn(self) -> float:
        """Seconds one candidate's turn in a side-by-side round takes, sized by the baseline's measured calls (a
        12-layer encoder's are 5x a CNN's): what the budget reserves for the re-measures is then what they take."""
        return racing.remeasure_seconds(self.baseline, self.protocol) if self.baseline is not None else 4.0

    def average_unit(self, original: str) -> float:
        """This run's average build and screening seconds per variant so far (the original's aside: it is timed longer)."""
        spent = [t for name, t in self.spent.items() if name != original]
        return sum(spent) / len(spent) if spent else FIRST_UNIT_SECONDS

    # ------------------------------------------------------------------------------------------------ reserves
    def here(self) -> list[Target]:
        """The targets whose candidates are re-measured here: not a GPU target on a machine without one."""
        return [t for t in self.targets if t.device.computes_on is not Device.GPU or gpu_present()] or self.targets

    def priced(self) -> int:
        """How many targets' picks are served and their capacity searched at the end."""
        return sum(t.served for t in self.targets) if self.capacity_probe else 0

    def capacity_reserve(self) -> float:
        return self.priced() * racing.CAPACITY_RESERVE_SECONDS

    def closing(self) -> float:
        return racing.closing_seconds(len(self.targets))

    def scaling_reserve(self, contenders: int) -> float:
        """The scaling of up to three candidates a target naming an instance and the baseline."""
        mine = [t for t in self.targets if t.names_instance]
        if not mine:
            return 0.0
        from servopt.bench.scaling import machine_cores

        cores = machine_cores()
        return racing.instance_seconds(min(contenders, 3 * len(mine)) + 1, cores, 0, self.batch_call_seconds() * cores)

    def poorer_isas(self) -> set[str]:
        """The instruction sets of the CPU targets poorer than this machine's: each gets a capped re-measure."""
        level = cpu_features().level
        return {t.isa for t in self.here() if t.device is Device.CPU and t.isa is not None and richer(level, t.isa)}

    def cappable(self, runtime: str) -> bool:
        """Whether a variant on ``runtime`` would be re-measured capped to a poorer target's instruction set."""
        return any(get_runtime(runtime).isa_cap_env(isa) is not None for isa in self.poorer_isas())

    def remeasure_reserve(self, contenders: int, cappable: bool = True) -> float:
        """Cold starts, the side-by-side rounds (and a poorer ISA's capped rounds, when a contender's runtime can be held
        to it: ``cappable``; ONNX Runtime's cannot, and its candidates' figures stand uncapped), the picks' axes."""
        here = self.here()
        remeasured = sum(t.device.computes_on is Device.CPU for t in here)  # interleave_candidates: CPU and edge targets
        capped = len(self.poorer_isas()) if cappable else 0  # a poorer ISA's target gets a capped re-measure of its own
        return racing.finish_estimate(self.rounds, len(here), contenders, self.axes, remeasured, self.remeasure_turn(),
                                      capped) - self.closing()

    def reserves(self, contenders: int, cappable: bool = True) -> dict[str, float]:
        """What each stage after screening is planned to take, for ``contenders`` variants that could be re-measured
        (``cappable``: one of them runs on a runtime a poorer target's ISA can be imposed on)."""
        return {"re-measure": self.remeasure_reserve(contenders, cappable), "scaling": self.scaling_reserve(contenders),
                "capacity": self.capacity_reserve(), "closing": self.closing()}

    def instance_reserve(self, contenders: int, capacity: bool = True) -> float:
        """The instance's answer at the end: the scaling and (``capacity``) the capacity searches."""
        return self.scaling_reserve(contenders) + (self.capacity_reserve() if capacity else 0.0)

    # ------------------------------------------------------------------------------------------------ deadlines
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self, closing: bool = True) -> float | None:
        """Seconds the budget leaves now, less the profiles and the report (``closing``); None without a budget."""
        if self.seconds is None:
            return None
        return self.seconds - self.elapsed() - (self.closing() if closing else 0.0)

    def left_before(self, stage: str) -> float | None:
        """Seconds left for the stages before ``stage`` (``capacity`` or ``closing``): what is left, less the reserves
        of ``stage`` and every stage after it."""
        if self.seconds is None:
            return None
        later = {"capacity": self.capacity_reserve() + self.closing(), "closing": self.closing()}[stage]
        return self.seconds - self.elapsed() - later

    def deadline(self, v: Variant) -> float | None:
        """When a screening job of ``v`` must end (``time.time()``): early enough to leave the capacity search and the
        closing their reserve; None without a budget, and for the original and the baseline (measured whatever it is)."""
        left = self.left_before("capacity")
        return None if left is None or v.is_original or v.is_baseline else time.time() + left

    def finish_deadline(self, stage: str = "re-measure") -> float | None:
        """When a job of the finish must end: a re-measure, a duel, the scaling, a cold start or a pick's axes before the
        capacity search's reserve; the capacity search before the closing's; a profile (``closing``) at the budget's
        end. Their time is planned, but a model's call time can outgrow any plan (MPNet's side-by-side re-measure took 2
        min of a 10-minute budget): the deadline is what makes the budget bind. None without a budget."""
        if self.seconds is None:
            return None
        # a profile ends where the report's own seconds begin: the command renders it once the sweep returns
        report = racing.closing_seconds(0)
        left = {"capacity": self.left_before("closing"), "closing": self.seconds - self.elapsed() - report}.get(stage)
        return time.time() + (left if left is not None else self.left_before("capacity"))

    def fits(self, units: list, contenders: int, original: str, cappable: bool = True) -> int:
        """How many of ``units`` (in order) fit the budget with every later stage's reserve kept: each costs what it
        took in an earlier run on this CPU, else this run's average so far (plus a compile for torch.compile); a round
        that does not fit whole is cut short rather than skipped. ``contenders``: variants measured so far that could be
        re-measured; ``cappable``: one of them, or of ``units``, runs on a runtime an ISA cap applies to."""
        if self.seconds is None:
            return len(units)
        learned = racing.learned_seconds(self.family, cpu_features())
        scale, average = racing.search_scale(self.batch_call_seconds()), self.average_unit(original)
        total = 0.0
        for count, u in enumerate(units, 1):
            total += racing.expected_seconds(u.variant, learned, average, scale)
            cappable = cappable or self.cappable(u.variant.runtime)
            if self.elapsed() + total + sum(self.reserves(contenders + count, cappable).values()) > self.seconds:
                return count - 1
        return len(units)

    def duel_seconds(self, figures: int) -> float | None:
        """How long a duel may take per figure: ``racing.DUEL_SECONDS_PER_FIGURE``, or what the budget leaves after
        loading the duel and the instance's answer, split between its figures; None when that is under
        ``racing.DUEL_MIN_SECONDS``."""
        most = 0.5 if self.quick else racing.DUEL_SECONDS_PER_FIGURE
        now = self.left()
        if now is None:
            return most
        left = (now - racing.DUEL_LOAD_SECONDS - self.instance_reserve(3)) / max(1, figures)
        return min(most, left) if left >= min(most, racing.DUEL_MIN_SECONDS) else None

    # ------------------------------------------------------------------------------------------------ the plan
    def plan(self, contenders: int, cappable: bool = True) -> BudgetPlan | None:
        """The plan as it stands (the reserves for ``contenders``) beside what each stage used and skipped."""
        if self.seconds is None:
            return None
        reserves = self.reserves(contenders, cappable)
        planned = {"original": self.used.get("original", 0.0), **reserves}
        planned["screening"] = max(0.0, self.seconds - sum(planned.values()))
        return BudgetPlan(seconds=self.seconds, label=self.label or "", batch_call_s=round(self.batch_call_seconds(), 4),
                          remeasure_turn_s=round(self.remeasure_turn(), 2),
                          stages=[BudgetStage(stage=s, planned_s=round(planned.get(s, 0.0), 1),
                                              used_s=round(self.used[s], 1) if s in self.used else None,
                                              skipped=self.skipped.get(s, [])) for s in STAGES])
