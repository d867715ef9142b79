"""The report's "Every variant" table: one row per record with its size, quality against the original (measured for
the same kind of node), latency, throughput, cold start, memory, the precision that ran and notes (noisy, provider
fallback, Pareto, node); and which records sit on a Pareto front."""

from __future__ import annotations

from dataclasses import dataclass

from servopt.contracts import Record
from servopt.families.base import Family
from servopt.report.formats import figure, label, precision_of
from servopt.report.sections import ReportInput, section


@dataclass
class VariantRow:
    name: str
    group: str
    status: str
    error: str
    size: str
    accuracy: str
    drop: str
    agree: str
    p50: str
    p95: str
    p99: str
    batch: str
    cold: str
    rss: str
    precision: str
    notes: str
    description: str


def variant_rows(records: list[Record], reference: Record | None, pareto: set[tuple[str, str | None]], family: Family,
                 references: dict[str | None, Record] | None = None) -> list[VariantRow]:
    """One row per record; quality against the original measured for the same kind of node where there is one."""
    rows = []
    for r in records:
        lat, tp = r.latency_ms, r.throughput_ips
        agreement = getattr(r.quality, "agreement", None)  # every built-in kind compares with the original's answers
        agr = agreement.top1_agreement if agreement else None
        ref = (references or {}).get(r.measured_for, reference)
        drop = family.quality_drop(r, ref) if r.status == "ok" or r.quality is not None else None
        notes = []
        if r.interference and r.interference.flagged:
            notes.append("noisy")
        session = r.environment.session if r.environment else None
        if session and session.provider_fallback:
            notes.append(f"provider fell back to {session.provider_actual}")
        if (r.name, r.measured_for) in pareto:
            notes.append("Pareto")
        if r.measured_for and r.environment and r.environment.node:
            notes.append(f"node {r.environment.node}")
        rows.append(VariantRow(
            name=label(r), group=r.group or "", status=r.status, error=r.error or "", size=figure(r.size_mb),
            accuracy=family.describe_quality(r), drop=figure(drop, "{:+.2f}") if drop is not None else "—",
            agree=figure(agr * 100 if agr is not None else None, "{:.1f}%"), p50=figure(lat.p50 if lat else None),
            p95=figure(lat.p95 if lat else None), p99=figure(lat.p99 if lat else None),
            batch=figure(tp.batch if tp else None, "{:.0f}"), cold=figure(r.cold_start_s), rss=figure(r.peak_rss_mb, "{:.0f}"),
            precision=precision_of(r), notes=", ".join(notes), description=r.description))
    return rows


def rows_of(r: ReportInput) -> list[VariantRow]:
    """The "Every variant" table's rows, built once per report (the INT8 section reads them too)."""
    if "rows" not in r.memo:
        r.memo["rows"] = variant_rows(r.records, r.reference, r.marks, r.family, r.references)
    return r.memo["rows"]


@section("rows")
def _rows(r: ReportInput) -> list[VariantRow]:
    return rows_of(r)


@section("pareto")
def _pareto(r: ReportInput) -> list:
    return r.summary.pareto_front


@section("left_out")
def _left_out(r: ReportInput) -> list:
    return r.config.left_out if r.config else []
