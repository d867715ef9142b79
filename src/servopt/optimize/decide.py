"""Check every variant against every target, pick the best per target, and say why.

A pure function of the records and the targets: every figure says where it was
measured (its record's ``environment``), so a report re-rendered on a laptop
decides a server's run exactly as the server did. A bound is ``pass``,
``fail`` or ``not measured`` (edge latency must be measured on the device; a
GPU target whose variants never ran on a GPU). Figures re-measured in the
interleaved run (A B A B with the reference) replace the sweep's figures for
the decision, so close calls are decided on same-run numbers. In a distributed
sweep each record says which kind of node it was measured for
(``Record.measured_for``), and a target is decided only on the records of its
own kind (``for_target``).

Variants this machine cannot tell apart on a target's objective (``noise``: side by side, a lead of 10 % on the
medians in most rounds, or from 5 rounds 3 % in every round, or a duel's verdict where one settled the pair — 3 % and
beyond its interval, block by block; otherwise beyond the intervals and the drift between two measurements) are
**tied**, and the pick among
them is the simplest recipe (``simplicity``): not a recovery of another variant's quality, no slow search, fewer
passes. A pick that flipped between equally fast INT8 variants on the noise of a shared machine helped no one, and a
racing sweep, which builds a recovery only when it is needed, lands on the same pick as the full sweep.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Literal

from pydantic import Field, model_validator

from servopt.contracts import Capacity, Contract, Duel, Interleaved, Projection, Record, Scaling
from servopt.cpu import CpuFeatures, Isa, richer
from servopt.errors import UserError
from servopt.families.base import Family
from servopt.machine import Device, machine_label
from servopt.optimize.noise import (
    DRIFT,
    SIDE_NOISE,
    SIGN_ROUNDS,
    TIE_GAP,
    clears,
    duel_ahead,
    duel_lead,
    gap,
    interval,
    rounds_won,
    surely_ahead_side_by_side,
)
from servopt.optimize.projection import instance_projections, served_shares, share_for
from servopt.optimize.scaling import ServedShare, why_not
from servopt.optimize.targets import Target
from servopt.passes.base import get_pass
from servopt.runtimes.base import get_runtime

# How summaries written before bounds said their kind and direction read them (their bounds had these names).
_V2_LOWER = ("throughput_ips", "cosine_mean", "runs_on_target_isa")
_V2_QUALITY = ("accuracy_drop_points", "cosine_mean", "spearman_drop_points")


class Bound(Contract):
    bound: str
    limit: float
    value: float | None
    status: Literal["pass", "fail", "not measured"]
    miss: float | None = None  # over the bound / short of it, as a share of it
    note: str = ""
    upper: bool = True  # the value must stay under the limit (False: reach it)
    kind: Literal["quality", "size", "speed", "isa"] = "speed"  # quality bounds come from the model's family
    # an instance-level bound judged on a projection from this machine's cores: ``value`` is its pessimistic end
    projection: Projection | None = None

    @model_validator(mode="before")
    @classmethod
    def _older(cls, data: Any) -> Any:
        if isinstance(data, dict) and "kind" not in data and "bound" in data:
            name = data["bound"]
            data = {**data, "upper": name not in _V2_LOWER, "kind": "quality" if name in _V2_QUALITY else
                    "size" if name == "size_mb" else "isa" if name == "runs_on_target_isa" else "speed"}
        return data


class Figures(Contract):
    p50_ms: float | None
    throughput_ips: float | None
    source: Literal["interleaved", "sweep"]
    isa_cap: str | None = None  # the runtime was held to this instruction set when these figures were taken
    capped_run: bool = False  # the figures come from a run that capped every runtime it could
    # the target's instance (``instance_vcpus``), projected from this machine's cores (``optimize.scaling``): its
    # throughput (the served capacity within the SLO where it was measured, else the offline batch loop's) and the p50
    # one request gets there. Instance-level bounds are judged on these, never on this machine's figures.
    instance_throughput: Projection | None = None
    instance_p50: Projection | None = None


class Price(Contract):
    """One variant's cost on one target's instance."""

    # at the capacity's pessimistic end (the band's low end: what a verdict is judged on and a load provisioned on);
    # summaries written before issue 42 priced the central figure here
    per_million_usd: float
    per_million_range_usd: list[float] | None = None  # over the capacity's band: (at its high end, at its low end)
    per_million_central_usd: float | None = None  # at the central figure
    capacity_ips: float | None = None  # the instance's samples/s that was priced (the band's low end)
    capacity_central_ips: float | None = None
    basis: Literal["served", "estimated", "offline"] = "offline"  # served within the SLO, offline × a served share, or offline
    projected: bool = False  # projected from this machine's cores to the instance's (else measured there)
    instances: int | None = None  # for the stated load, at the capacity's pessimistic end
    monthly_usd: float | None = None
    note: str
    # summaries written before projections (servopt.summary/2 of 2026-11): the instance assumed to serve ``scale`` ×
    # this machine's throughput, and the throughput within the latency bound
    scale: float | None = None
    per_million_at_bound_usd: float | None = None
    throughput_at_bound_ips: float | None = None



class Verdict(Contract):
    variant: str
    passes: bool
    bounds: list[Bound]
    figures: Figures
    total_miss: float
    notes: list[str] = Field(default_factory=list)
    price: Price | None = None  # its cost on the target's instance (``optimize.pricing``), where the target has a price


class Decision(Contract):
    target: Target
    status: str  # pass | pass (pending device) | undecided (not projected) | fail | not measured | no candidate
    recommended: str | None = None
    nearest: str | None = None
    shortfall: str | None = None  # the nearest miss's failed bounds, in words
    verdict: Verdict | None = None
    verdicts: list[Verdict] = Field(default_factory=list)
    tied: list[str] = Field(default_factory=list)  # as fast as the fastest (or as near as the nearest) within noise; the pick among them
    reason: str
    result: Record | None = None  # the recommended (or nearest) variant's record
    projected: str | None = None  # "projected from 2 cores to 8 vCPUs": the instance-level bounds were judged so
    capacity: Capacity | None = None  # the pick's served capacity within the target's SLO, on this machine's cores

    @property
    def pick(self) -> str | None:
        """The variant the target gets: the recommended one, else the nearest miss (served deliberately, priced, shown)."""
        return self.recommended if self.recommended is not None else self.nearest


def figures(rec: Record, interleaved: Interleaved | None) -> Figures:
    """p50 and batch throughput, from the interleaved run where it re-measured this variant."""
    il = interleaved.variants.get(rec.name) if interleaved else None
    if il and interleaved:
        capped_run = bool(interleaved.environment and interleaved.environment.isa_cap)
        return Figures(p50_ms=il.p50_ms, throughput_ips=il.throughput_ips, source="interleaved", isa_cap=il.isa_cap,
                       capped_run=capped_run)
    return Figures(p50_ms=rec.p50_ms, throughput_ips=rec.batch_ips, source="sweep")


def computes_on(rec: Record) -> Device:
    return Device.GPU if rec.needs_gpu else Device.CPU


def serves(target: Target, rec: Record) -> bool:
    """Whether the variant computes on the kind of device the target runs (an edge target takes CPU variants)."""
    return computes_on(rec) is target.device.computes_on


def eligible(target: Target, rec: Record) -> bool:
    return rec.status == "ok" and serves(target, rec)


def for_target(target: Target, records: list[Record]) -> list[Record]:
    """The records a target is decided on. One machine measured every record for every target (``measured_for`` is
    None throughout); a distributed sweep measured each variant once per kind of node, and a target sees only the
    records measured for its kind (``Target.kind``: its ``ray_resources``)."""
    if all(r.measured_for is None for r in records):
        return records
    return [r for r in records if r.measured_for == target.kind]


def _where(rec: Record) -> str:
    """The machine of a record's figures, and its node where a distributed sweep measured it."""
    env = rec.environment
    node = f" on node {env.node}" if rec.measured_for is not None and env and env.node else ""
    return machine_label(env) + node


def isa_note(target: Target, rec: Record, fig: Figures) -> str | None:
    """Whether the figures were taken with the target's instruction set, capped to it, or with a richer one."""
    env = rec.environment
    if target.isa is None or env is None:
        return None
    cap = fig.isa_cap or env.isa_cap
    if cap:
        return f"measured with the instruction set capped at {cap} (target: {target.isa})"
    measured = env.isa
    if richer(measured, target.isa):
        why = f"; {rec.runtime} cannot be held to {target.isa}" if fig.capped_run else ""
        return f"measured with a richer instruction set ({measured}) than the target's ({target.isa}){why}"
    return None


def instance_figures(target: Target, rec: Record, fig: Figures, scaling: Scaling | None,
                     capacity: Capacity | list[Capacity] | None, share: ServedShare | None = None) -> Figures:
    """``fig`` with the target's instance projected from this machine's cores (``projection.instance_projections``):
    its throughput (served, estimated from a served share, or offline) and one request's p50 with the instance's
    threads; ``fig`` itself where the target names no instance computed here."""
    served = [capacity] if isinstance(capacity, Capacity) else capacity or []
    tp, p50 = instance_projections(target, rec, scaling, served, share)
    if tp is None and p50 is None:
        return fig
    return fig.model_copy(update={"instance_throughput": tp, "instance_p50": p50})


BASIS_WORDS = {"served": "served capacity", "estimated": "estimated served capacity"}  # a projection's basis, as a bound says it


def _projection_words(proj: Projection, unit: str) -> str:
    what = BASIS_WORDS.get(proj.basis) or ("throughput" if proj.figure == "throughput_ips" else "one request's p50")
    return (f"{what} on the instance's {proj.to_cores} vCPUs {proj.value:.3g}{unit} (band: {proj.low:.3g}–{proj.high:.3g}), "
            f"{proj.note} ({proj.model}); judged at the pessimistic end")


def judge(target: Target, rec: Record, ref: Record | None, family: Family, interleaved: Interleaved | None = None,
          scaling: Scaling | None = None, capacity: Capacity | list[Capacity] | None = None,
          share: ServedShare | None = None) -> Verdict:
    """The verdict of one variant against one target, bound by bound. A target naming its instance's vCPUs has its
    speed bounds judged on the projection to that instance (``instance_figures``), at the interval's pessimistic end,
    and never on this machine's own figures."""
    fig = instance_figures(target, rec, figures(rec, interleaved), scaling, capacity, share)
    env = rec.environment
    bounds: list[Bound] = []

    def add(bound: str, limit: float, value: float | None, upper: bool, measurable: bool, note: str, kind: str,
            projection: Projection | None = None) -> None:
        if not measurable or value is None:
            status: Literal["pass", "fail", "not measured"] = "not measured"
        else:
            status = "pass" if (value <= limit if upper else value >= limit) else "fail"
        miss = None
        if status == "fail" and value is not None:
            miss = value / limit - 1 if upper else 1 - value / limit
        bounds.append(Bound(bound=bound, limit=limit, value=value, status=status, miss=miss, note=note, upper=upper, kind=kind,
                            projection=projection))

    for check in family.quality_bounds(target, rec, ref):  # the family knows what its quality is
        add(check.bound, check.limit, check.value, check.upper, check.value is not None, check.note, "quality")
    if target.max_size_mb is not None:
        add("size_mb", target.max_size_mb, rec.size_mb, True, True, "size on disk holds everywhere", "size")
    speed_here = target.device.measurable_on(env)
    speed_note = f"measured on {_where(rec)}, not on {target.hardware}" if speed_here else target.device.why_not_measurable()
    instance = target.instance_vcpus is not None and speed_here and target.device.computes_on is Device.CPU
    for bound, limit, local, proj, upper, unit in (
            ("p50_ms", target.max_p50_ms, fig.p50_ms, fig.instance_p50, True, " ms"),
            ("throughput_ips", target.min_throughput_ips, fig.throughput_ips, fig.instance_throughput, False, "/s")):
        if limit is None:
            continue
        if not instance:
            add(bound, limit, local, upper, speed_here, speed_note, "speed")
        elif proj is not None:  # the instance's figure: this machine's is never compared with the instance's bound
            add(bound, limit, proj.pessimistic, upper, True, f"{_projection_words(proj, unit)}; from {_where(rec)}, "
                f"not from {target.hardware}", "speed", proj)
        else:
            curve = scaling.curves.get(rec.name) if scaling else None
            add(bound, limit, None, upper, False, f"not projected to the instance's {target.instance_vcpus} vCPUs: "
                f"{why_not(curve)}", "speed")
    report = (rec.artifact.report or {}) if rec.artifact else {}
    if target.isa is not None and target.isa < Isa.AVX512_VNNI and saturates_without_vnni(rec):
        # verified where VNNI sums in 32 bits: on the target's CPU its 8-bit weights can overflow the U8S8 kernel's
        # int16 pair sums, the flaw behind all-mpnet-base-v2's 0.0104 cosine on an AVX2 Zen 2 and static U8S8's 5.43
        # points lost on the demo on an AVX2 Zen 3
        pairs = (report.get("u8s8_overflowing_pairs") or 0) + (report.get("s8s8_overflowing_pairs") or 0)
        signed = " (its signed activations shifted into it)" if report.get("s8s8_overflowing_pairs") else ""
        add("runs_on_target_isa", 1, 0, False, True,
            f"its 8-bit weights can overflow the U8S8 kernel's sums on a CPU without VNNI{signed} ({pairs} weight pairs "
            f"can): wrong answers on the target's {target.isa}; a variant with 7-bit weights (reduce_range, NNCF's "
            f"overflow fix) or U8U8 kernels runs there", "isa")
    built_block = report.get("nchwc_block")
    target_block = CpuFeatures.nchwc_block_of(target.isa) if target.isa is not None else None
    if built_block and built_block != target_block and (target_block or target.device == "edge"):
        # an edge target names no x86 rung: its CPU (ARM) lays convolutions out in another block, or not at all
        there = f"the target's {target.isa} uses {target_block}" if target_block else \
            f"the target's {target.hardware} does not lay them out so"
        add("runs_on_target_isa", 1, 0, False, True,
            f"its graph was saved in this CPU's NCHWc layout (blocks of {built_block} channels), {there}: ONNX Runtime "
            f"would run it there and answer wrongly (the demo's, saved on an AVX-512 CPU, scored 9.8 % top-1 on an AVX2 "
            f"one, against 97.3 %); the model ONNX Runtime optimizes at load (ort-fp32) runs there", "isa")
    if interleaved and rec.name in interleaved.failed:
        cap = interleaved.environment.isa_cap if interleaved.environment else None
        add("runs_on_target_isa", 1, 0, False, True,
            f"cannot run{f' with the instruction set capped at {cap}' if cap else ''}: {interleaved.failed[rec.name][:160]}", "isa")
    notes = [n for n in [isa_note(target, rec, fig)] if n]
    return Verdict(variant=rec.name, passes=all(b.status != "fail" for b in bounds), bounds=bounds, figures=fig,
                   total_miss=sum(b.miss or 0 for b in bounds if b.status == "fail"), notes=notes)


def saturates_without_vnni(rec: Record) -> bool:
    """Whether ``rec``'s INT8 model, verified on this machine, can answer wrongly on x86 without VNNI: its weights have
    pairs that overflow an int16 (the build's ``u8s8_overflow``), unless its runtime runs such a model on kernels
    that sum no int16 pairs (ONNX Runtime's x64 precision: U8U8). Signed activations a QDQ graph shifts into the
    U8S8 kernel (``s8s8_overflowing_pairs``) overflow in every runtime: x64 precision is not known to cover them."""
    report = (rec.artifact.report or {}) if rec.artifact else {}
    if report.get("safe_without_vnni") is not False:
        return False
    if report.get("s8s8_overflowing_pairs"):
        return True
    try:
        return get_runtime(rec.runtime).int8_kernel("u8s8", rec.options) != "u8u8"
    except UserError:  # a runtime no longer registered (a plugin gone): the weights' risk stands
        return True


def objective_key(target: Target, verdict: Verdict) -> float:
    f = verdict.figures
    if target.objective == "throughput":
        return -(f.throughput_ips or 0.0)
    return f.p50_ms if f.p50_ms is not None else float("inf")


def objective_dim(target: Target) -> str:
    return "throughput_ips" if target.objective == "throughput" else "p50_ms"


def speed_dims(target: Target) -> list[str]:
    """The speed figures a target uses: its objective's, and those it bounds."""
    dims = {objective_dim(target)}
    if target.max_p50_ms is not None:
        dims.add("p50_ms")
    if target.min_throughput_ips is not None:
        dims.add("throughput_ips")
    return sorted(dims)


def duel_decides(interleaved: Interleaved, duel: Duel, by_name: dict[str, Record]) -> bool:
    """Whether ``duel`` settles its pair, or the rounds do: the duel or the rounds, never both where they disagree.

    Where the duel's interval holds the rounds' median ratio they agree, and the duel, the finer instrument, decides.
    Where it excludes it, the rounds decide unless the two models run alike (one precision, sizes within 10 %): a
    duel alternates two models in one process every tenth of a second, each starting in the other's caches, which put
    an INT8 pick 9 % (AVX2 Zen 2) and 18-25 % (AVX2 Zen 3: 0.67x fp32's p50 against 0.76-0.82x) further ahead of fp32
    than separate processes found, where the rounds agreed with them (issue 40); two alike models pay that alike, and
    there the duel found a tie (0.6 % apart) that three rounds seconds apart had put 23 % apart (two 7-bit INT8 models,
    the same kernels on every conv)."""
    if interleaved.duel_disagrees(duel) is None:
        return True
    a, b = by_name.get(duel.a), by_name.get(duel.b)
    if a is None or b is None:
        return False

    def precision(r: Record) -> str | None:
        session = r.environment.session if r.environment else None
        return session.precision_actual if session else None

    sizes = sorted(x for x in (a.size_mb, b.size_mb) if x)
    return precision(a) == precision(b) is not None and len(sizes) == 2 and sizes[1] <= 1.1 * sizes[0]


def deciding_duel(interleaved: Interleaved | None, dim: str, a: str, b: str, by_name: dict[str, Record]) -> Duel | None:
    """The duel of ``a`` and ``b`` on ``dim`` where it settles the pair (``duel_decides``), else None."""
    duel = interleaved.duel(dim, a, b) if interleaved else None
    return duel if duel is not None and duel_decides(interleaved, duel, by_name) else None


def surely_ahead(dim: str, a: Verdict, b: Verdict, by_name: dict[str, Record], interleaved: Interleaved | None,
                 drift: float = DRIFT) -> bool:
    """Whether ``a`` is ahead of ``b`` on ``dim`` beyond this machine's noise: side by side when both were re-measured
    there (``noise.surely_ahead_side_by_side``), else beyond both 95 % intervals widened by ``drift``."""
    if interleaved and a.figures.source == b.figures.source == "interleaved":
        duel = deciding_duel(interleaved, dim, a.variant, b.variant, by_name)
        if duel is not None:  # block by block, agreeing with the rounds: a finer instrument (``Sweep.settle_ties``)
            return duel_ahead(duel, a.variant)
        return surely_ahead_side_by_side(dim, interleaved.variants[a.variant], interleaved.variants[b.variant])
    ia, ib = interval(by_name[a.variant], dim, drift), interval(by_name[b.variant], dim, drift)
    return ia is not None and ib is not None and clears(dim, ia, ib)


def tied(target: Target, passing: list[Verdict], by_name: dict[str, Record], interleaved: Interleaved | None) -> list[Verdict]:
    """The passing verdicts no other passing one is surely faster than on the objective: the fastest, and those this
    machine cannot tell from it. (Whatever beats a variant beyond noise in the race's screening is surely faster on
    the objective too, so a screened-out variant is never among them.)"""
    dim = objective_dim(target)
    return [v for v in passing if not any(surely_ahead(dim, w, v, by_name, interleaved) for w in passing if w is not v)]


def _fixed_misses(v: Verdict) -> dict[str, float]:
    """The misses of the bounds whose figures do not move between two measurements (quality, size, the ISA)."""
    return {b.bound: b.miss or 0.0 for b in v.bounds if b.kind != "speed"}


def no_worse_fixed(a: Verdict, b: Verdict) -> bool:
    mb = _fixed_misses(b)
    return all(m <= mb.get(k, 0.0) + 1e-12 for k, m in _fixed_misses(a).items())


def tied_nearest(target: Target, nearest: Verdict, pool: list[Verdict], by_name: dict[str, Record],
                 interleaved: Interleaved | None) -> list[Verdict]:
    """Where nothing passes: the verdicts as near as ``nearest`` (the least total miss) within noise — missing no
    fixed bound (quality, size) by more, ``nearest`` surely ahead on none of the target's speed figures —, less those
    another of them is surely ahead of on some speed figure without being surely behind on any, and those beaten
    beyond noise on every speed figure by any verdict missing no fixed bound by more (the race's screening rule, so
    screening cannot change the set)."""
    dims = speed_dims(target)

    def ahead(w: Verdict, v: Verdict) -> bool:
        return any(surely_ahead(d, w, v, by_name, interleaved) for d in dims)

    def dominated(v: Verdict) -> bool:
        return any(w is not v and no_worse_fixed(w, v) and all(surely_ahead(d, w, v, by_name, interleaved) for d in dims)
                   for w in pool)

    near = [v for v in pool if v is nearest or (no_worse_fixed(v, nearest) and not ahead(nearest, v) and not dominated(v))]
    best = [v for v in near if not any(w is not v and ahead(w, v) and not ahead(v, w) for w in near)]
    return best or [nearest]


def simplicity(rec: Record) -> tuple[bool, float, float, int, str]:
    """How simple a variant's recipe is, simplest first: not a recovery of another variant's quality (``refines``), no
    slow search among its passes (``Pass.slow_seconds``), then its place in the catalogue (which lists refinements
    cheapest first: the order a racing sweep builds them in, so both sweeps settle a tie the same way), fewer passes,
    its name."""
    slow = 0.0
    for step in rec.chain:
        with contextlib.suppress(UserError):  # a pass of an older servopt that is gone counts as not slow
            slow += get_pass(step.pass_name).slow_seconds
    index = float(rec.catalogue_index) if rec.catalogue_index is not None else math.inf
    return rec.refines is not None, slow, index, len(rec.chain), rec.name


def _overruled_duel(interleaved: Interleaved, dim: str, a: str, b: str, by_name: dict[str, Record]) -> str:
    """Words for a duel of ``a`` and ``b`` the rounds overruled (``duel_decides``), else ''."""
    duel = interleaved.duel(dim, a, b)
    rounds = interleaved.duel_disagrees(duel) if duel is not None else None
    if rounds is None or duel_decides(interleaved, duel, by_name):
        return ""
    lo, hi = sorted(duel.time_ratio_interval)
    return (f"; their duel block by block ({duel.a} / {duel.b}: {duel.time_ratio:.3f}, interval {lo:.3f}-{hi:.3f}) "
            f"excludes the rounds' {rounds:.3f}: the rounds decided (the two do not run alike, and a duel in one process "
            "overstated an INT8 pick against fp32 on AVX2 CPUs where the rounds agreed with separate processes)")


def _why_tied(dim: str, pick: Verdict, lead: Verdict, interleaved: Interleaved | None, by_name: dict[str, Record]) -> str:
    fp, fl = (pick.figures.p50_ms, lead.figures.p50_ms) if dim == "p50_ms" else (pick.figures.throughput_ips, lead.figures.throughput_ips)
    ahead = f"{gap(dim, fl, fp):.1%}" if fp and fl else "?"
    unit = "p50" if dim == "p50_ms" else "batch throughput"
    duel = deciding_duel(interleaved, dim, lead.variant, pick.variant, by_name)
    if duel is not None and pick.figures.source == lead.figures.source == "interleaved":
        lo, hi = sorted(1 / x - 1 if duel.a == lead.variant else x - 1 for x in duel.time_ratio_interval)
        return (f"{lead.variant} and {pick.variant} took turns block by block ({duel.pairs} pairs): {lead.variant} "
                f"{duel_lead(duel, lead.variant):.1%} ahead on {unit}, interval {lo:.1%} to {hi:.1%}: "
                + (f"within this machine's noise and {TIE_GAP:.0%}" if duel.verdict == "tie" else "not beyond this machine's noise"))
    if interleaved and pick.figures.source == lead.figures.source == "interleaved":
        won, n = rounds_won(dim, interleaved.variants[lead.variant], interleaved.variants[pick.variant])
        return (f"{lead.variant} is {ahead} ahead on {unit} side by side, in {won} of {n} rounds: not beyond this "
                f"machine's noise ({SIDE_NOISE:.0%} on the medians; from {SIGN_ROUNDS} rounds, every round and "
                f"{TIE_GAP:.0%})" + _overruled_duel(interleaved, dim, lead.variant, pick.variant, by_name))
    return f"{lead.variant} is {ahead} ahead on {unit}, within the two measurements' 95 % intervals and the drift between them"


def shortfall(verdict: Verdict) -> str:
    return ", ".join(
        f"{b.bound} {b.value:.3g}{_on_instance(b)} vs {'≤' if b.upper else '≥'} {b.limit:g} "
        f"({'over' if b.upper else 'short'} by {b.miss:.0%})"
        for b in verdict.bounds if b.status == "fail" and b.value is not None and b.miss is not None)


def _on_instance(b: Bound) -> str:
    """Where a failed bound's figure is the instance's: projected (its pessimistic end), or measured there."""
    if b.projection is None:
        return ""
    what = BASIS_WORDS.get(b.projection.basis, "")
    end = "high" if b.upper else "low"
    where = "measured" if b.projection.measured else f"projected, the band's {end} end; central {b.projection.value:.3g}"
    return f" ({what + ', ' if what else ''}instance of {b.projection.to_cores} vCPUs, {where})"


def projected_words(verdict: Verdict | None) -> str | None:
    """"projected from 2 cores to 8 vCPUs" where the verdict's instance-level bounds were judged on a projection."""
    projs = [b.projection for b in (verdict.bounds if verdict else []) if b.projection is not None]
    if not projs:
        return None
    measured = all(p.measured for p in projs)
    cores = max(max(p.cores_measured) for p in projs)
    return f"measured at {projs[0].to_cores} cores" if measured else f"projected from {cores} cores to {projs[0].to_cores} vCPUs"


def _unprojected(target: Target, v: Verdict) -> bool:
    """Whether ``v`` has a speed bound of ``target``'s instance that no projection judged."""
    return target.instance_vcpus is not None and any(b.kind == "speed" and b.status == "not measured" for b in v.bounds)


def decide(target: Target, records: list[Record], ref: Record | None, family: Family,
           interleaved: Interleaved | None = None, scaling: Scaling | None = None,
           capacity: Capacity | list[Capacity] | None = None) -> Decision:
    """Best passing variant under the target's objective, or the nearest miss and by how much. ``scaling`` (the
    candidates measured at 1, 2, … cores) and ``capacity`` (the pick's served capacity) judge a target's
    instance-level bounds on the projection to its instance (``judge``)."""
    records = for_target(target, records)
    candidates = [r for r in records if eligible(target, r)]
    skipped = [r.name for r in records if r.status == "skipped" and serves(target, r)]
    by_name = {r.name: r for r in records}
    if target.device is Device.GPU and not candidates:
        return Decision(target=target, status="not measured",
                        reason=f"no GPU variant was measured on a GPU; skipped: {', '.join(skipped) or 'none'}")
    served: dict[str, list[Capacity]] = {}  # per variant, each search (repeated searches: their spread is in the band)
    for c in [capacity] if isinstance(capacity, Capacity) else capacity or []:
        served.setdefault(c.variant, []).append(c)
    shares = served_shares(served, scaling, by_name)
    verdicts = [judge(target, r, ref, family, interleaved, scaling, served.get(r.name), share_for(r, shares))
                for r in candidates]
    # Decide on one source of figures: when the top candidates were re-measured side by side, pick among them
    # (comparing a sweep figure with an interleaved one would compare two different moments of a noisy machine).
    side_by_side = [v for v in verdicts if v.figures.source == "interleaved"]
    pool = side_by_side if target.device.computes_on is Device.CPU and side_by_side else verdicts
    # An instance's speed bound nothing projected is not met: where some variants were projected to the instance, one
    # that was not (the original, never a scaling candidate) is not among them, or it "passes" what the projected
    # ones fail (a 5-minute demo with a busy process on each core recommended PyTorch eager, 72 ms a request, for
    # cpu-server's 3 ms, and served it). With none projected, the decision stays "undecided (not projected)".
    judged = [v for v in pool if not _unprojected(target, v)]
    pool = judged or pool
    passing = sorted((v for v in pool if v.passes), key=lambda v: objective_key(target, v))
    objective = "highest batch throughput" if target.objective == "throughput" else "lowest p50 latency"
    if passing:
        fastest = passing[0]
        equal = tied(target, passing, by_name, interleaved)
        best = min(equal, key=lambda v: simplicity(by_name[v.variant]))
        others = [v.variant for v in equal if v is not best]
        pending = [b.bound for b in best.bounds if b.status == "not measured"]
        if best is fastest:
            reason = f"{best.variant}: meets every bound here with the {objective}"
            rest = [v.variant for v in passing if v is not best]
            if others:
                reason += f" (as fast within noise: {', '.join(others)}; it is the simplest recipe of them)"
            elif rest:
                reason += f" (next: {rest[0]})"
        elif not others:  # the rounds' medians put another first, but a duel found this one ahead beyond noise
            dim = objective_dim(target)
            duel = deciding_duel(interleaved, dim, best.variant, fastest.variant, by_name)
            how = (f"block by block ({duel.pairs} pairs): {best.variant} {duel_lead(duel, best.variant):.1%} ahead"
                   if duel is not None else "beyond this machine's noise")
            reason = (f"{best.variant}: meets every bound here with the {objective}: ahead of {fastest.variant} {how}, "
                      f"though {fastest.variant} had the better median over the rounds")
        else:
            reason = (f"{best.variant}: meets every bound here, tied on the {objective} "
                      f"({_why_tied(objective_dim(target), best, fastest, interleaved, by_name)}); "
                      f"the simplest recipe of the {len(equal)} tied ({', '.join(others)})")
        projected = projected_words(best)
        if pending:
            reason += f"; still to measure on {target.hardware}: {', '.join(pending)}"
        elif projected:
            reason += f" ({projected}: figures from {_where(by_name[best.variant])}, not from {target.hardware})"
        elif target.device is Device.CPU:
            reason += f" (figures from {_where(by_name[best.variant])}, not from {target.hardware})"
        reason += "".join(f"; {n}" for n in best.notes)
        # a CPU target's instance bounds with no projection (one core, an interrupted run) are not a pass: nothing judged
        # them, and a manager reading "pass" would price an instance no figure says meets them
        status = "pass" if not pending else "pass (pending device)" if target.device is not Device.CPU else "undecided (not projected)"
        return Decision(target=target, status=status, recommended=best.variant, verdict=best, verdicts=verdicts,
                        tied=[v.variant for v in equal], reason=reason, result=by_name[best.variant], projected=projected,
                        capacity=(served.get(best.variant) or [None])[-1])
    if not verdicts:
        return Decision(target=target, status="no candidate", reason="no variant ran successfully for this target")
    closest = min(pool, key=lambda v: (v.total_miss, objective_key(target, v)))
    equal = tied_nearest(target, closest, pool, by_name, interleaved)
    nearest = min(equal, key=lambda v: simplicity(by_name[v.variant]))
    misses = shortfall(nearest)
    reason = f"no variant passes; nearest is {nearest.variant}: {misses}"
    others = [v.variant for v in equal if v is not nearest]
    if others:
        reason += f" (as near within noise: {', '.join(others)}; it is the simplest recipe of them"
    if closest is not nearest:
        reason += ("; " if others else " (") + f"{closest.variant} misses by the least on these figures"
        if closest not in equal:
            reason += ", but is slower beyond noise on a speed figure"
    if others or closest is not nearest:
        reason += ")"
    projected = projected_words(nearest)
    return Decision(target=target, status="fail", nearest=nearest.variant, shortfall=misses, verdict=nearest, verdicts=verdicts,
                    tied=[v.variant for v in equal], reason=reason, result=by_name[nearest.variant], projected=projected,
                    capacity=(served.get(nearest.variant) or [None])[-1])
