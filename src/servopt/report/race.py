"""The report's "The race": what a racing sweep did not measure in full and why (the screened-out variants and what
beat them beyond noise), and what it did not try (the budget, or a refinement not needed)."""

from __future__ import annotations

from dataclasses import dataclass

from servopt.contracts import Record
from servopt.optimize.rundir import LeftOut, Summary
from servopt.report.formats import label
from servopt.report.sections import ReportInput, section


@dataclass
class RaceSection:
    summary: str
    screened: list[tuple[str, str]]
    not_tried: list[LeftOut]


def race_section(summary: Summary, records: list[Record]) -> RaceSection | None:
    """What a racing sweep did not measure in full, and why: the screened-out variants (what beat them), and what it
    did not try (the budget, or a refinement not needed)."""
    screened = [(label(r), r.screened_out) for r in records if r.screened_out]
    if not summary.racing and not summary.not_tried:
        return None
    wall = f" in {summary.wall_s:.0f} s" if summary.wall_s else ""
    budget = f" (budget {summary.budget_s:.0f} s)" if summary.budget_s else ""
    text = (f"A racing sweep{wall}{budget}: every variant was verified and measured briefly; {len(screened)} beaten beyond "
            "noise for every target they could serve got no cold start nor side-by-side re-measure. `--full` measures "
            "everything in full (the same decisions, slower).") if summary.racing else f"A full sweep{wall}{budget}."
    return RaceSection(summary=text, screened=screened, not_tried=summary.not_tried)


@section("race")
def _race(r: ReportInput) -> RaceSection | None:
    return race_section(r.summary, r.records)
