"""The report's side-by-side re-measures: same-run ratios against the reference (interleaved rounds), the close calls
settled block by block (duels), the rounds with the instruction set capped for a poorer target, and on a distributed
sweep each kind of node's own re-measures and Pareto front. Reads only the summary."""

from __future__ import annotations

from dataclasses import dataclass

from servopt.contracts import Interleaved, Record
from servopt.optimize.decide import duel_decides
from servopt.optimize.rundir import Summary
from servopt.report.formats import figure, machine_of
from servopt.report.sections import ReportInput, section


@dataclass
class RatioRow:
    name: str
    p50: str
    tp: str
    p50_ratio: str
    tp_ratio: str
    flagged: int
    capped: str = ""


def ratio_text(median: float | None, interval: list[float]) -> str:
    """A same-run ratio with its median's interval: ``0.81× [0.76–0.85]`` (the interval omitted where a record has none,
    or where it is the median itself: the reference's own)."""
    shown = figure(median, "{:.2f}×")
    if len(interval) == 2 and interval[0] != interval[1]:
        shown += f" [{interval[0]:.2f}–{interval[1]:.2f}]"
    return shown


def interleave_rows(il: Interleaved | None) -> list[RatioRow]:
    """One row per re-measured variant: its medians and its medians of per-round ratios to the reference, each with the
    median's interval (with few rounds, their range)."""
    if il is None:
        return []
    return [RatioRow(name=n + (" (process by process)" if v.method == "alternating" else ""), p50=figure(v.p50_ms),
                     tp=figure(v.throughput_ips, "{:.0f}"), p50_ratio=ratio_text(v.p50_ratio_vs_reference, v.p50_ratio_interval),
                     tp_ratio=ratio_text(v.throughput_ratio_vs_reference, v.throughput_ratio_interval), flagged=v.flagged_rounds,
                     capped=v.isa_cap or ("not cappable" if il.environment and il.environment.isa_cap else ""))
            for n, v in il.variants.items()]


@dataclass
class DuelRow:
    figure: str
    pair: str
    pairs: int
    ratio: str
    interval: str
    verdict: str
    rounds: str  # the rounds' median ratio of the pair
    decided: str  # which instrument decided the pair, and why


def duel_rows(il: Interleaved | None, records: list[Record]) -> list[DuelRow]:
    """The close calls the rounds left, settled block by block (``Sweep.settle_ties``): a's time per call over b's,
    beside the rounds' ratio of the pair and which of the two decided (``decide.duel_decides``)."""
    if il is None:
        return []
    by_name = {r.name: r for r in records}
    said = {"a": "first ahead", "b": "second ahead", "tie": "tie", "undecided": "cannot tell (a tie)"}
    rows = []
    for d in il.duels:
        rounds = il.rounds_ratio(d.what, d.a, d.b)
        disagree = il.duel_disagrees(d) is not None
        decider = ("the duel" if not disagree else "the duel: they disagree, but the two run alike (one precision, sizes "
                   "within 10 %)" if duel_decides(il, d, by_name) else "the rounds: they disagree, and the two do not run alike")
        rows.append(DuelRow(figure="p50" if d.what == "p50_ms" else "batch throughput", pair=f"{d.a} / {d.b}", pairs=d.pairs,
                            ratio=f"{d.time_ratio:.3f}", interval=f"{d.time_ratio_interval[0]:.3f}–{d.time_ratio_interval[1]:.3f}",
                            verdict=said[d.verdict], rounds=f"{rounds:.3f}" if rounds is not None else "–",
                            decided=decider))
    return rows


@dataclass
class CappedTable:
    isa: str
    rounds: int
    rows: list[RatioRow]


def capped_tables(summary: Summary) -> list[CappedTable]:
    """Per poorer target ISA: the candidates re-measured with each runtime held to it where it can be."""
    return [CappedTable(isa=isa, rounds=il.rounds, rows=interleave_rows(il)) for isa, il in summary.capped.items()]


@dataclass
class KindSection:
    """A distributed sweep's kind of node: where its records were measured, its re-measures and Pareto front."""

    kind: str
    resources: str
    nodes: str
    targets: str
    machine: str
    interleaved: list[RatioRow]
    rounds: int | None
    capped: list[CappedTable]
    pareto: list[str]


def kind_sections(summary: Summary) -> list[KindSection]:
    return [KindSection(kind=k.kind, resources=", ".join(f"{n}: {v:g}" for n, v in k.ray_resources.items()),
                        nodes=", ".join(k.nodes) or "none", targets=", ".join(k.targets), machine=machine_of(k.environment),
                        interleaved=interleave_rows(k.interleaved), rounds=k.interleaved.rounds if k.interleaved else None,
                        capped=[CappedTable(isa=isa, rounds=il.rounds, rows=interleave_rows(il)) for isa, il in k.capped.items()],
                        pareto=k.pareto_front)
            for k in summary.kinds]


@section("interleaved")
def _interleaved(r: ReportInput) -> list[RatioRow]:
    return interleave_rows(r.summary.interleaved)


@section("rounds")
def _rounds(r: ReportInput) -> int | None:
    return r.summary.interleaved.rounds if r.summary.interleaved else None


@section("duels")
def _duels(r: ReportInput) -> list[DuelRow]:
    return duel_rows(r.summary.interleaved, r.records)


@section("capped")
def _capped(r: ReportInput) -> list[CappedTable]:
    return capped_tables(r.summary)


@section("kinds")
def _kinds(r: ReportInput) -> list[KindSection]:
    return kind_sections(r.summary)
