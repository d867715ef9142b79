"""The report's "What it costs": per target with a price, the pick (or nearest) first and the other candidates that
pass, each priced at the instance's capacity the verdict judged — its band's pessimistic end (``pricing``) —, with
where the price comes from and what the band holds."""

from __future__ import annotations

from dataclasses import dataclass

from servopt.optimize.decide import Price
from servopt.optimize.rundir import Summary
from servopt.report.sections import ReportInput, section


@dataclass
class PriceRow:
    target: str
    variant: str
    pick: bool
    per_million: str  # at the capacity's pessimistic end (and the range over its band)
    capacity: str  # what was priced: the instance's samples/s, served or offline, measured or projected
    instances: str
    monthly: str


@dataclass
class PriceSection:
    rows: list[PriceRow]
    notes: list[str]  # per target: where its price comes from and the scaling assumed
    load: str


def usd(v: float | None) -> str:
    """Dollars with as many digits as the amount needs (a price per million can be a tenth of a cent)."""
    if v is None:
        return "—"
    return f"{v:,.0f}" if v >= 100 else f"{v:.2f}" if v >= 1 else f"{v:.3f}" if v >= 0.01 else f"{v:.4f}"


def capacity_words(p: Price) -> str:
    """What a price row priced, in words: the instance's samples/s, served or offline, measured or projected."""
    if p.capacity_ips is None:  # a summary written before projections
        return f"{p.throughput_at_bound_ips:,.0f}/s at the latency bound × {p.scale:g} (assumed)" if p.throughput_at_bound_ips and p.scale else "—"
    how = "projected" if p.projected else "measured"
    central = f" (band's low end; central {p.capacity_central_ips:,.0f}/s)" if p.capacity_central_ips is not None \
        and p.capacity_central_ips != p.capacity_ips else ""
    return f"{p.capacity_ips:,.0f}/s{central} {p.basis}, {how}"


def price_section(summary: Summary, limit: int = 6) -> PriceSection | None:
    """Per target with a price: the pick (or nearest) first, then the other candidates that pass (up to ``limit``)."""
    rows, notes = [], []
    for d in summary.targets:
        priced = [v for v in d.verdicts if v.price is not None]
        if not priced:
            continue
        pick = d.pick
        ordered = sorted(priced, key=lambda v: (v.variant != pick, not v.passes, v.price.per_million_usd))[:limit]
        for v in ordered:
            p = v.price
            span = f" ({usd(p.per_million_range_usd[0])}–{usd(p.per_million_range_usd[1])})" if p.per_million_range_usd else ""
            if p.per_million_central_usd is not None and p.per_million_range_usd:
                span = f" (central {usd(p.per_million_central_usd)}; band {span.strip(' ()')})"
            rows.append(PriceRow(target=d.target.name, variant=v.variant + ("" if v.passes else " (misses a bound)"), pick=v.variant == pick,
                                 per_million=usd(p.per_million_usd) + span, capacity=capacity_words(p),
                                 instances=str(p.instances) if p.instances else "—", monthly=usd(p.monthly_usd)))
        notes.append(f"{d.target.name}: {ordered[0].price.note}")
    if not rows:
        return None
    load = f"{summary.load_ips:g}/s" if summary.load_ips else "no load given (--load 500/s)"
    return PriceSection(rows=rows, notes=notes, load=load)


@section("prices")
def _prices(r: ReportInput) -> PriceSection | None:
    return price_section(r.summary)
