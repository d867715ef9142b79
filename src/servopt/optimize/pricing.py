"""What a verdict costs: the price of a million inferences, and the instances (and dollars a month) a stated load needs.

A target may carry the hourly price of the instance it stands for (``price_per_hour``, with ``price_source`` saying
where the number comes from and when) and that instance's vCPUs. The throughput is the one measured here, on this
machine's cores, so the price is scaled to them: an instance of ``instance_vcpus`` is assumed to serve
``instance_vcpus / measured cores`` times this machine's throughput (batch throughput scales close to linearly with
cores for these runtimes; the report says that it is assumed). Two figures per variant:
- at the measured batch throughput, with the interval that throughput's 95 % interval gives;
- at the target's latency bound: the batch throughput when one batch answers within ``max_p50_ms``, else one sample at
  a time (1 / p50) — what the instance serves while every answer meets the bound.
No cloud price list is fetched (servopt runs offline): the presets' prices are stated with their source and date, and
a user's own go in the target YAML. Pure functions of records and targets, like ``decide``.
"""

from __future__ import annotations

import math

from servopt.contracts import Record
from servopt.optimize.decide import Decision, Price, Verdict
from servopt.optimize.targets import Target

HOURS_PER_MONTH = 730.0


def _capacity_interval(rec: Record, throughput: float) -> tuple[float, float] | None:
    """The throughput's 95 % interval from the batch latency's (throughput moves inversely with a batch's latency)."""
    lat = rec.batch_latency_ms
    if lat is None or not lat.p50 or not lat.p50_ci95:
        return None
    lo, hi = lat.p50_ci95[:2]
    return throughput * lat.p50 / hi, throughput * lat.p50 / lo


def at_bound(target: Target, rec: Record, throughput: float | None, p50_ms: float | None) -> float | None:
    """Samples/s this machine serves while every answer meets the target's latency bound."""
    if target.max_p50_ms is None:
        return throughput
    batch = rec.batch_latency_ms.p50 if rec.batch_latency_ms else None
    if throughput and batch is not None and batch <= target.max_p50_ms:
        return throughput
    if p50_ms and p50_ms <= target.max_p50_ms:
        return 1000.0 / p50_ms
    return None


def price(target: Target, verdict: Verdict, rec: Record, load_ips: float | None) -> Price | None:
    """The cost of ``rec`` on ``target``'s instance, or None where the target has no price or the figures are not
    this target's (an edge device, a GPU target measured without a GPU)."""
    throughput = verdict.figures.throughput_ips
    env = rec.environment
    if target.price_per_hour is None or not throughput or env is None or not target.device.measurable_on(env):
        return None
    cores = env.cores_usable or env.cores or 1
    scale = (target.instance_vcpus or cores) / cores
    hourly = target.price_per_hour

    def per_million(ips: float) -> float:
        return hourly / (ips * scale * 3600.0) * 1e6

    interval = _capacity_interval(rec, throughput) if verdict.figures.source == "sweep" else None
    bound_ips = at_bound(target, rec, throughput, verdict.figures.p50_ms)
    instances = math.ceil(load_ips / (bound_ips * scale)) if load_ips and bound_ips else None
    note = (f"{hourly:g} USD/h ({target.price_source or 'your price'}); the instance's {target.instance_vcpus or cores} vCPUs "
            f"assumed to serve {scale:g}× the throughput measured on {cores} core(s) here")
    return Price(per_million_usd=per_million(throughput),
                 per_million_range_usd=[per_million(interval[1]), per_million(interval[0])] if interval else None,
                 per_million_at_bound_usd=per_million(bound_ips) if bound_ips else None,
                 throughput_at_bound_ips=bound_ips, instances=instances,
                 monthly_usd=instances * hourly * HOURS_PER_MONTH if instances else None, scale=scale, note=note)


def priced(decision: Decision, records: list[Record], load_ips: float | None) -> Decision:
    """The decision with every verdict priced (where its target has a price); ``records``: those it was decided on."""
    by_name = {r.name: r for r in records}
    target = decision.target

    def with_price(v: Verdict | None) -> Verdict | None:
        if v is None or v.variant not in by_name:
            return v
        return v.model_copy(update={"price": price(target, v, by_name[v.variant], load_ips)})

    return decision.model_copy(update={"verdict": with_price(decision.verdict),
                                       "verdicts": [with_price(v) for v in decision.verdicts]})
