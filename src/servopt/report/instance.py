"""The report's "on the target's instance" section: how the candidates scaled with this machine's cores (the fitted
law and its band, projected to the instance), and the pick's served capacity (offered rate → p50/p99, the SLO and the
knee). Reads only the summary, like the rest of the report; its charts are in ``charts`` with the others."""

from __future__ import annotations

from dataclasses import dataclass

from servopt.contracts import Scaling
from servopt.optimize.rundir import Summary
from servopt.optimize.scaling import fit_usl, medians, noise_words, why_not
from servopt.report.sections import ReportInput, section


@dataclass
class ScalingRow:
    variant: str
    points: str  # "1: 212/s, 2: 420/s"
    law: str
    projection: str  # the instance's figure, per target naming one


@dataclass
class CapacityRow:
    target: str
    variant: str
    slo: str
    capacity: str
    config: str
    tried: str
    steps: list[str]


@dataclass
class InstanceSection:
    scaling: list[ScalingRow]
    capacity: list[CapacityRow]
    layout: str


def scaling_curves(summary: Summary) -> Scaling | None:
    """The scaling curves of this machine, or of the first kind of node that has some (a distributed sweep)."""
    return summary.scaling or next((k.scaling for k in summary.kinds if k.scaling), None)


def instance_section(summary: Summary) -> InstanceSection | None:
    """Rows for the tables: every scaled candidate's points and law, each target's projections; each capacity search."""
    scaling = scaling_curves(summary)
    capacities = [(d.target.name, d.capacity) for d in summary.targets if d.capacity is not None]
    if scaling is None and not capacities:
        return None
    rows = []
    for name, curve in (scaling.curves.items() if scaling else []):
        if why_not(curve):
            rows.append(ScalingRow(name, "—", why_not(curve) or "", "—"))
            continue
        cores, values = medians(curve, "throughput_ips")
        pts = ", ".join(f"{n}: {v:,.0f}/s" for n, v in zip(cores, values, strict=True))
        law = fit_usl(cores, values).describe(len(cores)) + noise_words(curve)
        proj = []
        for d in summary.targets:
            v = next((v for v in d.verdicts if v.variant == name), None)
            tp = v.figures.instance_throughput if v else None
            if tp is not None:
                proj.append(f"{d.target.name}: {tp.value:,.0f}/s ({tp.low:,.0f}–{tp.high:,.0f}) on {tp.to_cores} vCPUs, {tp.basis}")
        rows.append(ScalingRow(name, pts, law, "; ".join(proj) or "—"))
    caps = []
    for target, c in capacities:
        assert c is not None
        caps.append(CapacityRow(
            target=target, variant=c.variant, slo=c.slo, capacity=f"{c.capacity_rps:,.1f} requests/s on {c.cores} core(s)"
            + ("" if c.knee_found else " (at least: no failing rate reached)") + ("" if c.confirmed else " (not confirmed)")
            + (f", confirmed below the short steps' knee ({c.knee_rps:,.0f}/s)" if c.knee_rps and c.confirmed else "")
            + (f"; the search stopped: {c.stopped}" if c.stopped else "")
            + (f"; sent: {c.requests}, latency from each request's schedule" if c.requests else ""),
            config=c.config.label if c.config else "—",
            tried="; ".join(f"{cfg.label}: {cap:,.1f}/s" for cfg, cap in c.tried) or "—",
            steps=[f"{s.rate_rps:,.1f}/s{' (confirming)' if s.confirming else ''}: p50 {_ms(s.p50_ms)}, p99 {_ms(s.p99_ms)}"
                   + (f", claimed {_ms(s.claim_ms)} at {s.confidence:.0%} ({s.requests} of {s.needed} queries)"
                      if s.needed is not None and s.confidence is not None else "")
                   + f", {s.errors} errors → {'meets' if s.meets else 'misses'}"
                   + ("" if s.valid else f" (not valid: {s.invalid or 'the client fell behind'})") for s in c.steps]))
    layout = ("one single-thread instance per core (the layout servopt serve runs for throughput), all working at once; "
              "one request: one session with every core's thread")
    return InstanceSection(rows, caps, layout)


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} ms"


@section("instance")
def _instance(r: ReportInput) -> InstanceSection | None:
    return instance_section(r.summary)
