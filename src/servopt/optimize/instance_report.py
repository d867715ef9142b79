"""The report's "on the target's instance" section: how the candidates scaled with this machine's cores (the fitted
law and its band, projected to the instance), and the pick's served capacity (offered rate → p50/p99, the SLO and the
knee). Reads only the summary, like the rest of the report; its charts are inline SVG drawn with matplotlib (none
without it)."""

from __future__ import annotations

import io
from dataclasses import dataclass

from servopt.contracts import Capacity, Scaling
from servopt.optimize.rundir import Summary
from servopt.optimize.scaling import band, fit_usl, medians, noise_words, why_not


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


def _curves(summary: Summary) -> Scaling | None:
    return summary.scaling or next((k.scaling for k in summary.kinds if k.scaling), None)


def instance_section(summary: Summary) -> InstanceSection | None:
    """Rows for the tables: every scaled candidate's points and law, each target's projections; each capacity search."""
    scaling = _curves(summary)
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
            + ("" if c.knee_found else " (at least: no failing rate reached)") + ("" if c.confirmed else " (not confirmed)"),
            config=c.config.label if c.config else "—",
            tried="; ".join(f"{cfg.label}: {cap:,.1f}/s" for cfg, cap in c.tried) or "—",
            steps=[f"{s.rate_rps:,.1f}/s{' (confirming)' if s.confirming else ''}: p50 {_ms(s.p50_ms)}, p99 {_ms(s.p99_ms)}, "
                   f"{s.errors} errors → {'meets' if s.meets else 'misses'}{'' if s.valid else ' (not valid)'}" for s in c.steps]))
    layout = ("one single-thread instance per core (the layout servopt serve runs for throughput), all working at once; "
              "one request: one session with every core's thread")
    return InstanceSection(rows, caps, layout)


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} ms"


def svg(fig) -> str:
    """A matplotlib figure as inline SVG (closed once drawn): every chart of the report."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def instance_charts(summary: Summary) -> dict[str, str]:
    """``scaling``: cores → throughput, each candidate's points, fit and 95 % band out to the instance's vCPUs;
    ``capacity``: offered rate → p50/p99 of each capacity search, the SLO and the capacity found."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}

    out: dict[str, str] = {}
    scaling = _curves(summary)
    vcpus = max((d.target.instance_vcpus or 0 for d in summary.targets), default=0)
    curves = [c for c in (scaling.curves.values() if scaling else []) if why_not(c) is None]
    if curves and vcpus:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, c in enumerate(curves):
            colour = f"C{i % 10}"
            for p in c.points:
                ax.scatter([p.cores] * len(p.throughput_ips), p.throughput_ips, s=14, color=colour, alpha=0.6, zorder=3)
            cores, fit, lo, hi = band(c, max(vcpus, max(p.cores for p in c.points)))
            ax.plot(cores, fit, color=colour, label=c.variant)
            ax.fill_between(cores, lo, hi, color=colour, alpha=0.15)
        ax.axvline(max(p.cores for p in curves[0].points), color="grey", ls=":", lw=1)
        for d in summary.targets:
            if d.target.min_throughput_ips and d.target.instance_vcpus:
                ax.axhline(d.target.min_throughput_ips, color="#d62728", ls="--", lw=1, label=f"{d.target.name}: ≥ {d.target.min_throughput_ips:g}/s")
        ax.set_xlabel("cores (measured up to the dotted line; beyond it the fitted law and its 95 % band)")
        ax.set_ylabel("offline throughput, samples/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        out["scaling"] = svg(fig)
    caps = [(d.target, d.capacity) for d in summary.targets if d.capacity is not None and d.capacity.steps]
    if caps:
        fig, axes = plt.subplots(1, len(caps), figsize=(8 * len(caps), 4.2), squeeze=False)
        for ax, (target, c) in zip(axes[0], caps, strict=True):
            _capacity_chart(ax, c, target.name)
        out["capacity"] = svg(fig)
    return out


def _capacity_chart(ax, c: Capacity, target: str) -> None:
    steps = sorted((s for s in c.steps if s.p99_ms is not None), key=lambda s: s.rate_rps)
    rates = [s.rate_rps for s in steps]
    ax.plot(rates, [s.p50_ms for s in steps], "o-", color="C0", label="p50")
    ax.plot(rates, [s.p99_ms for s in steps], "s-", color="C1", label="p99")
    for s in steps:
        if not s.meets:
            ax.scatter([s.rate_rps], [s.p99_ms], s=60, facecolors="none", edgecolors="#d62728", zorder=4)
    limit = float(c.slo.split("<=")[1].split()[0]) if "<=" in c.slo else None
    if limit:
        ax.axhline(limit, color="#d62728", ls="--", lw=1, label=c.slo)
    if c.capacity_rps:
        ax.axvline(c.capacity_rps, color="#2ca02c", ls=":", lw=1.5, label=f"capacity {c.capacity_rps:,.0f}/s")
    import matplotlib.ticker

    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _p: f"{v:g}"))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("offered rate, requests/s (Poisson arrivals; log; circled: missed the SLO)")
    ax.set_ylabel("latency, ms (log)")
    ax.set_title(f"{target}: {c.variant} served, {c.config.label if c.config else ''}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
