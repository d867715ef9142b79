"""The report's INT8 sections: every INT8 variant's points lost and what it did to keep its accuracy, in the words of
the passes that built it (``Pass.describe`` of each step with ``Pass.int8_recipe``: a new pass needs no edit here),
and the accuracy-aware search's steps where a variant ran one."""

from __future__ import annotations

from typing import Any

from servopt.contracts import Record
from servopt.passes.base import PASSES
from servopt.report.formats import label
from servopt.report.sections import ReportInput, section
from servopt.report.variants import VariantRow, rows_of


def recovered_by(r: Record) -> str:
    """What an INT8 variant did to keep its accuracy: each INT8-recipe step of its chain in its pass's words (the last
    step with the build report it wrote), and the runtime's U8U8 kernels where its options ask for them. A pass not
    installed here (a plugin of the run's machine) is left out."""
    PASSES.load()
    said = []
    last = len(r.chain) - 1
    for i, step in enumerate(r.chain):
        cls = PASSES.classes.get(step.pass_name)
        if cls is not None and cls.int8_recipe:
            said.append(cls.describe(cls.read_params(step.params), r.build_report if i == last else None))
    if r.options.get("x64_quant_precision"):
        said.append("ONNX Runtime's x64 precision (U8U8) kernels")
    return "; ".join(said) or "—"


def int8_rows(rows: list[VariantRow], records: list[Record]) -> list[tuple[VariantRow, str]]:
    """Every INT8 variant: the points it lost (from its row) and what recovered them."""
    by_label = {label(r): r for r in records}
    return [(row, recovered_by(by_label[row.name])) for row in rows if row.group == "int8" and row.name in by_label]


def accuracy_search(records: list[Record]) -> dict[str, Any] | None:
    """The build report of an accuracy-aware search (its steps, scores and the layers kept in float), if one ran."""
    return next((r.build_report for r in records if r.status in ("ok", "failed") and r.build_report and "steps" in r.build_report), None)


@section("int8")
def _int8(r: ReportInput) -> list[tuple[VariantRow, str]]:
    return int8_rows(rows_of(r), r.records)


@section("search")
def _search(r: ReportInput) -> dict[str, Any] | None:
    return accuracy_search(r.records)
