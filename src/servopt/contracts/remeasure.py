"""What the sweep measures after the race: side-by-side rounds and duels (``Interleaved``), the time budget's plan,
and operator profiles."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from servopt.contracts.base import Contract
from servopt.contracts.environment import Environment
from servopt.contracts.record import Phase


class SideBySide(Contract):
    """One variant in an interleaved re-measure: medians over rounds, and medians of per-round ratios."""

    p50_ms: float
    throughput_ips: float
    p50_ms_rounds: list[float]
    throughput_rounds: list[float]
    p50_ratio_vs_reference: float
    throughput_ratio_vs_reference: float
    # the per-round ratios' median's interval (``bench.stats.median_interval``; with few rounds, their range) and its
    # exact coverage; empty in a re-measure stored before they were
    p50_ratio_interval: list[float] = Field(default_factory=list)
    throughput_ratio_interval: list[float] = Field(default_factory=list)
    ratio_coverage: float | None = None
    flagged_rounds: int
    isa_cap: str | None = None  # the instruction set this variant's runtime was held to in this run (None: not capped)
    # interleaved: in one process with the reference; alternating: a fresh process per round, taking turns with the
    # reference (a runtime in an environment of its own), its figures scaled to the interleaved reference's
    method: Literal["interleaved", "alternating"] = "interleaved"


class Duel(Contract):
    """Two variants on one speed figure, taking turns block by block in one process (``bench.duel``), each opened as
    served (no spinning threads), a block's first calls after a switch not counted: a block is a tenth of a second or so
    of counted calls, so the machine's drift between the two is that, not the seconds between two rounds of the
    interleaved re-measure."""

    a: str
    b: str
    what: Literal["p50_ms", "throughput_ips"]
    pairs: int  # blocks of each, taken in turns
    time_ratio: float  # median over pairs of a's time per call / b's (below 1: a is faster)
    time_ratio_interval: list[float]  # the median's distribution-free interval (z of the job: wider than 95 % for several looks)
    verdict: Literal["a", "b", "tie", "undecided"]  # ahead beyond noise by at least the job's gap; within it; can't tell


class Duels(Contract):
    """The result of a ``DuelJob``: every pair of its variants on every figure asked."""

    duels: list[Duel]
    seconds: float
    environment: Environment | None = None
    phases: list[Phase] = Field(default_factory=list)


class Interleaved(Contract):
    reference: str
    rounds: int
    order: list[str]
    variants: dict[str, SideBySide]
    failed: dict[str, str] = Field(default_factory=dict)  # variants that could not even open here (e.g. bf16 under an AVX2 cap)
    environment: Environment | None = None
    phases: list[Phase] = Field(default_factory=list)
    cache_key: str | None = None
    # the close calls the rounds left, settled block by block (``Sweep.settle_ties``); their verdicts replace the
    # rounds' for the pairs and figures they cover
    duels: list[Duel] = Field(default_factory=list)
    # how many duel jobs ``Sweep.settle_ties`` ran on these rounds: a resumed run goes on from there, and measures
    # nothing more once the first reached its bound (its last duel may have left the new pick with close calls)
    settle_rounds: int = 0

    def duel(self, what: str, a: str, b: str) -> Duel | None:
        """The duel of ``a`` and ``b`` on ``what``, either way round."""
        return next((d for d in self.duels if d.what == what and {d.a, d.b} == {a, b}), None)

    def rounds_ratio(self, what: str, a: str, b: str) -> float | None:
        """The rounds' median of ``a``'s time per call over ``b``'s on ``what`` (a duel's ``time_ratio``), round by round."""
        va, vb = self.variants.get(a), self.variants.get(b)
        if va is None or vb is None:
            return None
        pairs = (list(zip(va.p50_ms_rounds, vb.p50_ms_rounds, strict=False)) if what == "p50_ms"
                 else [(y, x) for x, y in zip(va.throughput_rounds, vb.throughput_rounds, strict=False)])
        ratios = sorted(x / y for x, y in pairs if x and y)
        if not ratios:
            return None
        mid = len(ratios) // 2
        return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2

    def duel_disagrees(self, duel: Duel) -> float | None:
        """The rounds' median ratio of the duel's pair where the duel's interval excludes it, else None."""
        ratio = self.rounds_ratio(duel.what, duel.a, duel.b)
        lo, hi = sorted(duel.time_ratio_interval)
        return ratio if ratio is not None and not lo <= ratio <= hi else None

    def covers(self, names: list[str], figures: list[str]) -> bool:
        """Whether every pair of ``names`` has had its duel on every one of ``figures``."""
        return all(self.duel(f, a, b) for f in figures for i, a in enumerate(names) for b in names[i + 1:])

    def with_duels(self, new: list[Duel]) -> Interleaved:
        """These figures with ``new`` duels, which replace any earlier one of the same pair and figure."""
        kept = [d for d in self.duels if not any(x.what == d.what and {x.a, x.b} == {d.a, d.b} for x in new)]
        return self.model_copy(update={"duels": [*kept, *new]})


class BudgetStage(Contract):
    """One stage of a sweep under a time budget: what the plan gave it, what it used, what it left out for the time."""

    stage: str
    planned_s: float
    used_s: float | None = None  # None: it did not run
    skipped: list[str] = Field(default_factory=list)


class BudgetPlan(Contract):
    """How a sweep planned its ``--budget`` from this run's own costs (the baseline's batch call, a side-by-side turn),
    stage by stage, and what each stage used (``optimize.budget.Budget``)."""

    seconds: float
    label: str = ""
    batch_call_s: float  # one batch call of the baseline on all cores: what the finish's reserves are sized from
    remeasure_turn_s: float  # one candidate's turn in a side-by-side round
    stages: list[BudgetStage]


class OpTime(Contract):
    op: str
    ms_per_run: float
    share: float
    calls_per_run: float


class OpProfile(Contract):
    """Where the time goes, op by op (a profile job's result)."""

    variant: str = ""
    profiler: str
    total_ms_per_run: float
    ops: list[OpTime] = Field(default_factory=list)
    error: str | None = None
