"""The report's top: the verdict per target (status, pick, why, each bound with its limit and value), whether the
machine that measured has the target's instruction set, which machine that was, and the banners of an interrupted
run or one that reused an earlier run's figures. Reads only the summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from servopt.cpu import richer
from servopt.optimize.rundir import Summary
from servopt.report.formats import figure, machine_of
from servopt.report.sections import ReportInput, section


@dataclass
class BoundRow:
    bound: str
    limit: float
    value: str
    status: str
    note: str


@dataclass
class VerdictRow:
    name: str
    hardware: str
    device: str
    status: str
    recommended: str
    reason: str
    bounds: list[BoundRow] = field(default_factory=list)
    isa: str = ""


def verdict_rows(summary: Summary) -> list[VerdictRow]:
    """One row per target: its pick (or the nearest miss) and every bound it was judged on."""
    rows = []
    for d in summary.targets:
        target = d.target
        recommended = d.recommended if d.recommended else f"none (nearest: {d.nearest})" if d.nearest else "none"
        rows.append(VerdictRow(
            name=target.name, hardware=target.hardware + (f" ({target.isa})" if target.isa else ""), device=target.device,
            status=d.status + (f" ({d.projected})" if d.projected else ""), recommended=recommended, reason=d.reason,
            isa=isa_match(summary, target.isa, target.kind),
            bounds=[BoundRow(bound=b.bound + (" (instance)" if b.projection else ""), limit=b.limit, value=figure(b.value, "{:.3g}"),
                             status=b.status, note=b.note) for b in (d.verdict.bounds if d.verdict else [])]))
    return rows


def isa_match(summary: Summary, target_isa: str | None, kind: str | None = None) -> str:
    """Whether the machine that measured has the target's instruction set (per target, for the verdicts): this
    machine, or on a distributed sweep the nodes of the target's kind."""
    of_kind = summary.kind(kind)
    env = of_kind.environment if of_kind and of_kind.environment else summary.environment
    capped = of_kind.capped if of_kind else summary.capped
    if target_isa is None or env is None:
        return ""
    here = env.isa
    if here == target_isa:
        return f"measured on the target's instruction set ({here})"
    if richer(here, target_isa):
        how = "re-measured capped where runtimes allow" if target_isa in capped else "not capped"
        return f"this machine is {here}, richer than the target's {target_isa}: {how}"
    return f"this machine is {here}, poorer than the target's {target_isa}"


def machine_line(summary: Summary) -> str:
    """Where the figures come from: this machine, or (distributed) each kind of node's own section."""
    if summary.kinds:
        return f"the nodes of each kind below (distributed sweep; run from {machine_of(summary.environment)})"
    return machine_of(summary.environment)


def interrupted_banner(summary: Summary) -> str | None:
    """The top of an interrupted run's report: what its picks are worth and what it did not finish."""
    if not summary.interrupted:
        return None
    unfinished = [v.name for v in summary.not_tried if v.why.startswith("not finished")]
    return ("The run was stopped (SIGINT/SIGTERM): the picks below are the best answer from what was measured by then, "
            "without the side-by-side re-measure. Not finished: " + (", ".join(unfinished) or "none") +
            ". Rerun the same command to finish (finished variants are kept).")


def reused_line(summary: Summary) -> str | None:
    """Which figures came from an earlier run into the same folder instead of being measured again."""
    if not summary.reused:
        return None
    return (f"reused from an earlier run into this folder (the same variant, data, protocol, machine and library versions): "
            f"{len(summary.reused)} — {', '.join(summary.reused)}")


@section("verdicts")
def _verdicts(r: ReportInput) -> list[VerdictRow]:
    return verdict_rows(r.summary)


@section("machine")
def _machine(r: ReportInput) -> str:
    return machine_line(r.summary)


@section("interrupted")
def _interrupted(r: ReportInput) -> str | None:
    return interrupted_banner(r.summary)


@section("reused")
def _reused(r: ReportInput) -> str | None:
    return reused_line(r.summary)
