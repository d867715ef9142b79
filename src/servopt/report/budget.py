"""The report's "The time budget": how the sweep planned its ``--budget`` from this run's own costs, stage by stage,
what each stage used, and what it left out for the time (``optimize.budget.Budget``)."""

from __future__ import annotations

from dataclasses import dataclass

from servopt.optimize.rundir import Summary
from servopt.report.sections import ReportInput, section


@dataclass
class BudgetRow:
    stage: str
    planned: str
    used: str
    skipped: str


@dataclass
class BudgetSection:
    summary: str
    rows: list[BudgetRow]


def budget_section(summary: Summary) -> BudgetSection | None:
    """The plan beside its use; None for a run without a budget (or one stored before plans were)."""
    plan = summary.budget
    if plan is None:
        return None
    wall = f"{summary.wall_s:.0f} s" if summary.wall_s else "?"
    text = (f"--budget {plan.label or f'{plan.seconds:.0f}s'} ({plan.seconds:.0f} s), {wall} used. Planned from this run's "
            f"own costs: the baseline's batch call of {plan.batch_call_s * 1000:.0f} ms on all cores, a side-by-side turn of "
            f"{plan.remeasure_turn_s:.1f} s; the stages after screening were reserved from the start, the capacity search's "
            "first (a job of an earlier stage ends where that reserve begins).")
    rows = [BudgetRow(stage=s.stage, planned=f"{s.planned_s:.0f} s", used="–" if s.used_s is None else f"{s.used_s:.0f} s",
                      skipped=", ".join(s.skipped)) for s in plan.stages]
    return BudgetSection(summary=text, rows=rows)


@section("budget")
def _budget(r: ReportInput) -> BudgetSection | None:
    return budget_section(r.summary)
