"""One variant's figures on a target's instance: its throughput and one request's p50, projected from this machine's
cores (``scaling``, per physical core: ``layout``) with the band that holds what varies (``allowance``) — what
``decide`` judges an instance's bounds on and ``pricing`` prices.

The throughput is the served capacity within the SLO where this variant was served (each search's, where repeated);
else, where another variant was served, its offline figure × the share of its offline figure serving kept (``share``:
a served variant of the same runtime first, at most 1); else the offline batch loop's. A served figure and the curve
it is divided by are like with like: both held to the target's instruction set, or neither (``held``). Pure, like
``decide``.
"""

from __future__ import annotations

from servopt.contracts import Capacity, Projection, Record, Scaling, ScalingCurve
from servopt.cpu import Isa
from servopt.errors import UserError
from servopt.machine import Device
from servopt.optimize.allowance import cpu_change, held_to, served_figures, served_spread
from servopt.optimize.scaling import (
    Served,
    ServedShare,
    Shape,
    project_estimated,
    project_latency,
    project_throughput,
    run_ratio,
    served_share,
    why_not,
)
from servopt.optimize.targets import Target
from servopt.runtimes.base import get_runtime


def cappable(runtime: str, isa: Isa | str | None) -> bool:
    """Whether ``runtime`` can be held to ``isa`` here (``Runtime.isa_cap_env``)."""
    if isa is None:
        return False
    try:
        return get_runtime(runtime).isa_cap_env(Isa(isa)) is not None
    except (UserError, ValueError):  # a runtime no longer registered, a rung off the ladder
        return False


def curve_held(scaling: Scaling | None, runtime: str) -> bool:
    """Whether ``scaling``'s curve of a ``runtime`` variant was held to an instruction set (the job capped it)."""
    return bool(scaling and scaling.isa_cap and cappable(runtime, scaling.isa_cap))


def like_with_like(capacity: Capacity, scaling: Scaling | None, runtime: str) -> bool:
    """A served capacity and its variant's scaling curve both held to the same instruction set, or neither: a share of
    one over the other is then the server's, not the CPU's (a capacity served with VNNI over a curve held to AVX2
    would credit the server with the instruction set)."""
    served_cap = capacity.environment.isa_cap if capacity.environment else None
    return bool(served_cap) == curve_held(scaling, runtime)


def served_shares(served: dict[str, list[Capacity]], scaling: Scaling | None, records: dict[str, Record]) -> list[ServedShare]:
    """Each served variant's share of its offline figure (``scaling.served_share``, at most 1), where it was served
    like with like (``like_with_like``) and found a capacity; the spread of its searches rides along."""
    out = []
    for name, caps in served.items():
        ok = [c for c in caps if c.error is None and c.capacity_rps > 0]
        rec = records.get(name)
        if not ok or scaling is None or rec is None or not all(like_with_like(c, scaling, rec.runtime) for c in ok):
            continue
        figures = served_figures(ok)
        median = sorted(figures)[len(figures) // 2]
        share = served_share(scaling.curves.get(name), median, ok[-1].cores, name, rec.runtime)
        if share is not None:
            out.append(ServedShare(share.share, name, share.cores, rec.runtime, served_spread(ok)))
    return out


def share_for(rec: Record, shares: list[ServedShare]) -> ServedShare | None:
    """The share a variant that was not served is judged at: the largest a served variant of its own runtime kept
    (its server costs alike), else the largest any kept — the most favourable one seen, so a variant not yet served is
    not ruled out by another's heavier serving costs, and never judged on a figure no server could reach (each ≤ 1)."""
    mine = [s for s in shares if s.variant != rec.name]
    same = [s for s in mine if s.runtime == rec.runtime]
    return max(same or mine, key=lambda s: s.share, default=None)


def instance_projections(target: Target, rec: Record, scaling: Scaling | None, served: list[Capacity],
                         share: ServedShare | None) -> tuple[Projection | None, Projection | None]:
    """(throughput, one request's p50) on ``target``'s instance for ``rec``; (None, None) where the target names no
    instance whose kind of device computes here, or the variant's curve cannot be projected from."""
    env = rec.environment
    if target.instance_vcpus is None or not target.device.measurable_on(env) or target.device.computes_on is not Device.CPU:
        return None, None
    curve: ScalingCurve | None = scaling.curves.get(rec.name) if scaling else None
    if scaling is None or curve is None or why_not(curve) is not None:
        return None, None
    topology = scaling.environment.topology if scaling.environment else None
    run = run_ratio(scaling)
    shape = Shape(target.instance_vcpus, target.instance_threads)
    p50 = project_latency(curve, shape, topology, run)
    held = curve_held(scaling, rec.runtime) or held_to(scaling.environment, False, target.isa)
    # a capacity of 0 (no rate tried met the SLO) is a served figure too: the instance serves nothing within it
    mine = [c for c in served if c.variant == rec.name and c.error is None]
    if mine:
        last = mine[-1]
        served_env = last.environment or scaling.environment
        held = held_to(served_env, cappable(rec.runtime, target.isa), target.isa)
        allowances = [a for a in (served_spread(mine), cpu_change(rec, served_env, held, target.isa)) if a is not None]
        tp = project_throughput(curve, shape, topology, Served(served_figures(mine), last.cores or 1), allowances, run)
        if tp is not None:
            searches = f"{len(mine)} searches" if len(mine) > 1 else f"{last.capacity_rps:.0f} requests/s"
            tp = tp.model_copy(update={"note": f"served within {last.slo} on {last.cores} core(s) here ({searches}), scaled "
                                               f"by the fitted law: {tp.note}"})
        return tp, p50
    cpu = cpu_change(rec, scaling.environment, held, target.isa)
    if share is not None and share.variant != rec.name:
        allowances = [a for a in (share.spread, cpu) if a is not None]
        return project_estimated(curve, shape, share, topology, allowances, run), p50
    return project_throughput(curve, shape, topology, None, [cpu] if cpu else [], run), p50
