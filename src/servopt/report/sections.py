"""What every section of the report reads (``ReportInput``: the run as stored, and what several sections derive from
it once), and the registry of sections: a section is a function of a ``ReportInput`` registered under the name its
templates use (``@section("prices")``), so a new section is one module in ``report/`` plus a line in each template
(``render`` imports every module of the package)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from servopt.contracts import Record
from servopt.families.base import Family, family_of
from servopt.optimize.rundir import RunConfig, Summary, load_config


@dataclass
class ReportInput:
    """A run directory's stored results: nothing here measures."""

    out: Path
    summary: Summary
    records: list[Record]
    memo: dict[str, Any] = field(default_factory=dict)  # what one section builds and another reads, built once

    @cached_property
    def config(self) -> RunConfig | None:
        return load_config(self.out)

    @cached_property
    def family(self) -> Family:
        if self.config is not None:
            return family_of(self.config.spec)
        from servopt.families import FAMILIES

        return FAMILIES.get("image-classification")

    @cached_property
    def reference(self) -> Record | None:
        return next((r for r in self.records if r.name == self.summary.reference), None)

    @cached_property
    def references(self) -> dict[str | None, Record]:
        return references_by_kind(self.records, self.summary.reference)

    @cached_property
    def marks(self) -> set[tuple[str, str | None]]:
        return pareto_marks(self.summary)

    @cached_property
    def picked(self) -> list[tuple[str, str | None]]:
        """Each target's pick and the kind of node it was measured on, once."""
        return list(dict.fromkeys((str(d.pick), d.result.measured_for if d.result else None)
                                  for d in self.summary.targets if d.pick))


def pareto_marks(summary: Summary) -> set[tuple[str, str | None]]:
    """(variant, kind) on a Pareto front: one machine's, or each kind of node's own."""
    return {(n, None) for n in summary.pareto_front} | {(n, k.kind) for k in summary.kinds for n in k.pareto_front}


def references_by_kind(records: list[Record], reference_name: str | None) -> dict[str | None, Record]:
    """The original's record per kind of node (None: this machine): what each record's quality is judged against."""
    return {r.measured_for: r for r in records if r.name == reference_name}


Section = Callable[[ReportInput], Any]
SECTIONS: dict[str, Section] = {}


def section(name: str) -> Callable[[Section], Section]:
    """Register a section under the name the templates read it by."""

    def register(fn: Section) -> Section:
        if name in SECTIONS:
            raise ValueError(f"two report sections are named {name!r}")
        SECTIONS[name] = fn
        return fn

    return register
