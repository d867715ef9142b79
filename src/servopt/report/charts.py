"""Every chart of the report, drawn with matplotlib into inline SVG (no CDN, no JavaScript: the report opens offline
and prints): the variants' latency against quality with the Pareto frontier, throughput, size and latency
distributions; on a target's instance, how the candidates scaled with the cores and the pick's served capacity.
Without matplotlib (a lean install) every function returns no chart and the report says so."""

from __future__ import annotations

import io

import numpy as np

from servopt.contracts import Capacity, Record
from servopt.families.base import Family
from servopt.optimize.rundir import Summary
from servopt.optimize.scaling import band, run_ratio, why_not
from servopt.report.formats import label
from servopt.report.instance import scaling_curves


def svg(fig) -> str:
    """A matplotlib figure as inline SVG (closed once drawn): every chart of the report."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def variant_charts(records: list[Record], reference: Record | None, pareto: set[tuple[str, str | None]], family: Family,
           highlight: list[str] | tuple[str, ...] = (), references: dict[str | None, Record] | None = None) -> dict[str, str]:
    """Inline SVG charts; empty when matplotlib is not installed."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    ok = [r for r in records if r.status == "ok" and r.latency_ms]
    if not ok:
        return {}

    def p50(r: Record) -> float:
        assert r.latency_ms is not None
        return r.latency_ms.p50

    def ref_of(r: Record) -> Record | None:
        return (references or {}).get(r.measured_for, reference)

    out = {}
    fig, ax = plt.subplots(figsize=(9, 4.8))
    labelled = set(highlight) | ({reference.name} if reference else set())
    placed: list[tuple[float, float]] = []
    for r in ok:
        drop = family.quality_drop(r, ref_of(r)) or 0.0
        x, y = p50(r), -drop
        on_front = (r.name, r.measured_for) in pareto
        ax.scatter(x, y, s=60 if on_front else 22, c="#d62728" if on_front else "#1f77b4", alpha=0.9 if on_front else 0.6, zorder=3)
        if on_front or r.name in labelled:  # only the points that matter are named; the table lists every variant
            dy = 6 + 9 * sum(1 for px, py in placed if abs(np.log(px / x)) < 0.25 and abs(py - y) < 0.05)
            ax.annotate(label(r), (x, y), fontsize=7.5, xytext=(4, dy), textcoords="offset points")
            placed.append((x, y))
    for kind in dict.fromkeys(r.measured_for for r in ok):  # one frontier per kind of node: figures of one machine
        front = sorted((r for r in ok if r.measured_for == kind and (r.name, kind) in pareto), key=p50)
        if front:
            ax.step([p50(r) for r in front], [-(family.quality_drop(r, ref_of(r)) or 0) for r in front], where="post",
                    color="#d62728", alpha=0.5, label="Pareto frontier" + (f" ({kind})" if kind else ""))
    if any((r.name, r.measured_for) in pareto for r in ok):
        ax.legend()
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _p: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _p: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
    ax.set_xlabel("p50 single-sample latency, ms (log)")
    ax.set_ylabel("quality change vs original, points")
    ax.grid(alpha=0.3)
    out["scatter"] = svg(fig)
    names = [label(r) for r in ok]
    for key, axis_label, values in [
        ("throughput", "batch throughput, samples/s", [r.batch_ips or 0 for r in ok]),
        ("size", "size on disk, MB", [r.size_mb or 0 for r in ok]),
    ]:
        fig, ax = plt.subplots(figsize=(8, 0.28 * len(ok) + 1))
        ax.barh(names, values, color="#2ca02c" if key == "throughput" else "#9467bd")
        ax.set_xlabel(axis_label)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="y", labelsize=7)
        out[key] = svg(fig)
    with_samples = [r for r in ok if r.latency_samples_ms]
    if with_samples:
        fig, ax = plt.subplots(figsize=(8, 0.28 * len(with_samples) + 1))
        ax.boxplot([r.latency_samples_ms for r in with_samples], vert=False, showfliers=False, tick_labels=[label(r) for r in with_samples])
        ax.set_xscale("log")
        ax.set_xlabel("single-sample latency, ms (box: quartiles, whiskers: 1.5 IQR)")
        ax.tick_params(axis="y", labelsize=7)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        out["latency"] = svg(fig)
    return out


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
    scaling = scaling_curves(summary)
    vcpus = max((d.target.instance_vcpus or 0 for d in summary.targets), default=0)
    threads = max((d.target.instance_threads for d in summary.targets if d.target.instance_vcpus), default=1)
    topology = scaling.environment.topology if scaling and scaling.environment else None
    curves = [c for c in (scaling.curves.values() if scaling else []) if why_not(c) is None]
    run = run_ratio(scaling)
    if curves and vcpus:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, c in enumerate(curves):
            colour = f"C{i % 10}"
            for p in c.points:
                ax.scatter([p.cores] * len(p.throughput_ips), p.throughput_ips, s=14, color=colour, alpha=0.6, zorder=3)
            cores, fit, lo, hi = band(c, max(vcpus, max(p.cores for p in c.points)), topology, threads, run)
            ax.plot(cores, fit, color=colour, label=c.variant)
            ax.fill_between(cores, lo, hi, color=colour, alpha=0.15)
        ax.axvline(max(p.cores for p in curves[0].points), color="grey", ls=":", lw=1)
        for d in summary.targets:
            if d.target.min_throughput_ips and d.target.instance_vcpus:
                ax.axhline(d.target.min_throughput_ips, color="#d62728", ls="--", lw=1, label=f"{d.target.name}: ≥ {d.target.min_throughput_ips:g}/s")
        ax.set_xlabel(f"vCPUs ({threads} per core on the instance; measured here up to the dotted line, the fitted per-core "
                      "law and its band beyond)")
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
    if c.knee_rps:
        ax.axvline(c.knee_rps, color="#7f7f7f", ls=":", lw=1, label=f"knee (short steps) {c.knee_rps:,.0f}/s")
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
