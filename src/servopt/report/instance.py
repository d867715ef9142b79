"""The report's "on the target's instance" section: how the candidates scaled with this machine's vCPUs (how they were
read — cores, or a core's second threads —, the per-core law fitted, its check on the held-out second vCPU, and the
projection to the instance's cores × threads), what each target's band holds, and the pick's served capacity (offered
rate → p50/p99, the SLO and the knee). Reads only the summary, like the rest of the report; its charts are in
``charts`` with the others."""

from __future__ import annotations

from dataclasses import dataclass, field

from servopt.contracts import Capacity, Scaling, confirming_votes
from servopt.optimize.rundir import Summary
from servopt.optimize.scaling import check, check_words, fit_law, host_reading, medians, noise_words, run_ratio, why_not
from servopt.report.sections import ReportInput, section


@dataclass
class ScalingRow:
    variant: str
    points: str  # "1: 212/s, 2: 420/s"
    law: str
    projection: str  # the instance's figure, per target naming one
    check: str = "—"  # the law fitted on 1 vCPU against the 2 measured (held out)


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
    host: str = ""  # how this machine's vCPUs were read (sibling lists, the 1 → 2 step)
    bands: list[str] = field(default_factory=list)  # per target, what its pick's band holds


def scaling_curves(summary: Summary) -> Scaling | None:
    """The scaling curves of this machine, or of the first kind of node that has some (a distributed sweep)."""
    return summary.scaling or next((k.scaling for k in summary.kinds if k.scaling), None)


def instance_section(summary: Summary) -> InstanceSection | None:
    """Rows for the tables: every scaled candidate's points and law, each target's projections; each capacity search."""
    scaling = scaling_curves(summary)
    capacities = [(d.target.name, d.capacity) for d in summary.targets if d.capacity is not None]
    if scaling is None and not capacities:
        return None
    rows, hosts = [], []
    topology = scaling.environment.topology if scaling and scaling.environment else None
    run = run_ratio(scaling)
    for name, curve in (scaling.curves.items() if scaling else []):
        if why_not(curve):
            rows.append(ScalingRow(name, "—", why_not(curve) or "", "—"))
            continue
        cores, values = medians(curve, "throughput_ips")
        pts = ", ".join(f"{n}: {v:,.0f}/s" for n, v in zip(cores, values, strict=True))
        host = host_reading(curve, topology, run)
        fitted = fit_law(cores, values, host)
        law = (f"{host.words}; σ = {fitted.law.sigma:.3f}{'' if fitted.sigma_measured else ' (assumed)'}, λ = "
               f"{fitted.law.lam:,.1f}/s per core" + (f", SMT ×{fitted.law.smt:.2f} (measured)" if fitted.smt_measured else "")
               + noise_words(curve))
        hosts.append(host.words)
        proj = []
        for d in summary.targets:
            v = next((v for v in d.verdicts if v.variant == name), None)
            tp = v.figures.instance_throughput if v else None
            if tp is not None:
                proj.append(f"{d.target.name}: {tp.value:,.0f}/s ({tp.low:,.0f}–{tp.high:,.0f}) on {tp.to_cores} vCPUs, {tp.basis}")
        held_out = check(curve, topology)
        rows.append(ScalingRow(name, pts, law, "; ".join(proj) or "—", check_words(held_out) if held_out else "—"))
    caps = []
    for target, c in capacities:
        assert c is not None
        caps.append(CapacityRow(
            target=target, variant=c.variant, slo=c.slo, capacity=f"{c.capacity_rps:,.1f} requests/s on {c.cores} core(s)"
            + ("" if c.knee_found else " (at least: no failing rate reached)") + ("" if c.confirmed else " (not confirmed)")
            + (f", confirmed below the short steps' knee ({c.knee_rps:,.0f}/s){_confirmed_by(c)}" if c.knee_rps and c.confirmed else "")
            + (f"; the search stopped: {c.stopped}" if c.stopped else "")
            + (f"; sent: {c.requests}, latency from each request's schedule" if c.requests else ""),
            config=c.config.label if c.config else "—",
            tried="; ".join(f"{cfg.label}: {cap:,.1f}/s" for cfg, cap in c.tried) or "—",
            steps=[f"{s.rate_rps:,.1f}/s{' (confirming)' if s.confirming else ''}: p50 {_ms(s.p50_ms)}, p99 {_ms(s.p99_ms)}"
                   + (f", claimed {_ms(s.claim_ms)} at {s.confidence:.0%} ({s.requests} queries, {s.needed} needed for the claim)"
                      if s.needed is not None and s.confidence is not None else "")
                   + f", {s.errors} errors → {'meets' if s.meets else 'misses'}"
                   + ("" if s.valid else f" (not valid: {s.invalid or 'the client fell behind'})") for s in c.steps]))
    layout = ("one single-thread instance per vCPU (the layout servopt serve runs for throughput), all working at once; "
              "one request: one session with every vCPU's thread")
    host = (f"{topology.cpus} vCPUs on {topology.cores} physical core(s), {topology.threads_per_core} thread(s) per core "
            f"({'sysfs sibling lists' if topology.source == 'sysfs' else 'no topology read: each vCPU a core'})"
            if topology else "no topology recorded (an older run): each vCPU read as a core")
    return InstanceSection(rows, caps, layout, host, band_notes(summary))


def band_notes(summary: Summary) -> list[str]:
    """Per target naming an instance, what its pick's (or nearest's) throughput band holds: the instance as cores ×
    threads, each factor assumed with its range, each allowance."""
    out = []
    for d in summary.targets:
        pick = d.pick
        v = next((v for v in d.verdicts if v.variant == pick), None)
        tp = v.figures.instance_throughput if v else None
        if tp is None:
            continue
        held = "; ".join([*tp.assumed, *(a.words for a in tp.allowances)]) or "the scaling rounds' noise alone"
        layout = f" — {tp.layout}" if tp.layout else ""  # a summary of an older servopt: no layout recorded
        out.append(f"{d.target.name} ({pick}): {tp.value:,.0f}/s, band {tp.low:,.0f}–{tp.high:,.0f}/s{layout}. "
                   f"The band holds: {held}" + (". Held at the figure measured on fewer vCPUs" if tp.floored else ""))
    return out


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} ms"


@section("instance")
def _instance(r: ReportInput) -> InstanceSection | None:
    return instance_section(r.summary)


def _confirmed_by(c: Capacity) -> str:
    """" by 2 of 2 runs of 20 s (p99 31.3, 37.3 ms)": the confirming runs at the rate reported (the majority decides)."""
    runs, rerun = confirming_votes(c.steps, c.capacity_rps)
    if not runs:
        return ""
    figures = ", ".join(_ms(s.p99_ms).removesuffix(" ms") for s in runs)
    again = f"; {rerun} more not valid, run again" if rerun else ""
    return (f" by {sum(s.meets for s in runs)} of {len(runs)} runs of {max(s.duration_s for s in runs):.0f} s "
            f"(p99 {figures} ms{again})")
