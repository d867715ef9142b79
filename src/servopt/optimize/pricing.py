"""What a verdict costs: the price of a million inferences, and the instances (and dollars a month) a stated load needs.

A target may carry the hourly price of the instance it stands for (``price_per_hour``, with ``price_source`` saying
where the number comes from and when) and that instance's vCPUs (``instance_vcpus``). The figure priced is the one the
verdict judged the throughput bound on (``decide.instance_figures``): the instance's capacity projected from this
machine's cores (``optimize.scaling``) — the served capacity within the target's SLO where the pick's was measured
(``Target.max_p99_ms``), else the offline batch loop's — so the verdict and the price quote the same figure, at the
same end of its band: the pessimistic one, which holds the rounds' noise, the served capacity's spread between
searches and the CPU change (``optimize.allowance``), so a manager who provisions on it is not short when the next
search, or the target's CPU, gives less:
- the price of a million at the band's low capacity, with the range its band gives and the central figure's price;
- the instances a load needs at that same end.
A target without ``instance_vcpus`` is priced on this machine's own throughput, one machine for one instance, and
says so; a target naming vCPUs whose figures could not be projected is not priced (a figure of this machine is never
priced as if it were the instance's). No cloud price list is fetched (servopt runs offline): the presets' prices are
stated with their source and date, and a user's own go in the target YAML. Pure functions of records and targets,
like ``decide``.
"""

from __future__ import annotations

import math

from servopt.contracts import Projection, Record
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


def band_words(proj: Projection) -> str:
    """What a projection's band holds, in short: the rounds' noise, each unmeasured factor, each allowance."""
    parts = ["the scaling rounds' noise"]
    parts += [a.split(" assumed ")[0] + " (assumed)" for a in proj.assumed]
    parts += [{"served": "the served capacity's spread between searches", "cpu": "the CPU change"}[a.what]
              + f" ×{a.low:.2f}" for a in proj.allowances]
    if "drawn from" in proj.note:
        parts.append("the repeated capacity searches")
    return ", ".join(parts)


def price(target: Target, verdict: Verdict, rec: Record, load_ips: float | None) -> Price | None:
    """The cost of ``rec`` on ``target``'s instance, or None where the target has no price, the figures are not this
    target's (an edge device, a GPU target measured without a GPU), or the instance's figure could not be projected."""
    env = rec.environment
    if target.price_per_hour is None or env is None or not target.device.measurable_on(env):
        return None
    hourly = target.price_per_hour

    def per_million(ips: float) -> float:
        return hourly / (ips * 3600.0) * 1e6

    proj = verdict.figures.instance_throughput
    if proj is not None:
        capacity, low, high = proj.value, proj.low, proj.high
        where = "measured there" if proj.measured else f"projected from {max(proj.cores_measured)} cores here ({proj.model})"
        what = {"served": "served within the SLO", "estimated": "offline × the share another variant kept served"}.get(
            proj.basis, "offline batch loop")
        note = (f"{hourly:g} USD/h ({target.price_source or 'your price'}); capacity of {proj.to_cores} vCPUs, {what}, {where}; "
                f"priced at its band's low end, which holds {band_words(proj)}")
        basis, projected = proj.basis, not proj.measured
    elif target.instance_vcpus is None and verdict.figures.throughput_ips:
        capacity = verdict.figures.throughput_ips
        interval = _capacity_interval(rec, capacity) if verdict.figures.source == "sweep" else None
        low, high = interval if interval else (capacity, capacity)
        cores = env.cores_usable or env.cores or 1
        note = (f"{hourly:g} USD/h ({target.price_source or 'your price'}); the target names no instance_vcpus: priced as "
                f"if one instance served what {cores} core(s) of this machine did (offline batch loop)")
        basis, projected = "offline", False
    else:
        return None
    if capacity <= 0 or low <= 0:  # served within the SLO at no rate tried: nothing to price (the verdict's bound says so)
        return None
    instances = math.ceil(load_ips / low) if load_ips else None
    return Price(per_million_usd=per_million(low), per_million_range_usd=[per_million(high), per_million(low)],
                 per_million_central_usd=per_million(capacity), capacity_ips=low, capacity_central_ips=capacity, basis=basis,
                 projected=projected, instances=instances,
                 monthly_usd=instances * hourly * HOURS_PER_MONTH if instances else None, note=note)


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
