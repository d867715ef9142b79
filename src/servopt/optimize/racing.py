"""The race: which variants can still win a target, what order to try them in, and what earlier runs taught.

A racing sweep (irace, Hyperband's successive halving, Triton model_analyzer's quick search) measures every variant
briefly and spends the long measurements only on the contenders. Here a variant is **screened out** when, for every
target it could serve, another variant beats it on everything that target asks for — each quality bound and the size
missed by no more, and every speed figure the target uses (its objective, its p50 and throughput bounds) better
*beyond the noise*: the winner's pessimistic end of its 95 % interval still ahead of the loser's optimistic end, by a
margin for the drift between two moments of a shared machine. Such a variant can be neither a target's pick nor its
nearest miss, so the decisions stay those of the full sweep.

Order by expected value: the throughput ratio to the baseline that earlier runs of the same model family measured on
a CPU with the same features (``$SERVOPT_HOME/history.jsonl``), else a prior from the CPU's features. With a time
budget, the likely winners are measured first.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from servopt.contracts import Record, SideBySide
from servopt.cpu import CpuFeatures, Int8Kernel, Isa, richer
from servopt.errors import UserError
from servopt.families.base import Family
from servopt.home import default_home
from servopt.machine import cpu_features
from servopt.optimize.decide import eligible, judge, speed_dims
from servopt.optimize.noise import DRIFT, SCREENING_DRIFT, ahead_every_round, clears, interval, point
from servopt.optimize.targets import Target
from servopt.optimize.variants import machine_signature, measured_with
from servopt.passes.base import get_pass
from servopt.results import append_jsonl, read_jsonl
from servopt.runtimes.base import get_runtime

DETERMINISTIC = ("quality", "size")  # bounds whose figures do not move between two measurements
# A side-by-side lead (same process, alternated rounds) that counts: ahead by this much in every round.
SIDE_MARGIN = 0.05


def history_path() -> Path:
    return default_home() / "history.jsonl"


def _signature(cpu: CpuFeatures) -> str:
    return ",".join(sorted(cpu.flags))


def prior(name: str, group: str, cpu: CpuFeatures) -> float:
    """What a variant is expected to give, as a log throughput ratio to the baseline, before any run of this family on
    this CPU: INT8 first (much more where the CPU has 8-bit dot products), then OpenVINO, ONNX Runtime's graph
    variants, and PyTorch; bf16/fp16 only pay where the CPU computes them."""
    base = {"int8": 0.6, "openvino": 0.2, "onnxruntime": 0.0, "openvino-ep": 0.0, "fp16": -0.5, "pytorch": -0.7, "lab": -1.5,
            "gpu": -2.0}.get(group, -0.2)
    if group == "int8" and cpu.int8_dot:
        base += 0.3
    if "bf16" in name:
        base += 0.4 if cpu.bf16 else -1.0
    if "fp16" in name:
        base += 0.3 if cpu.fp16 else -0.5
    return base


# An INT8 recipe the CPU computes wrongly or slowly (``CpuFeatures.int8_trouble``: full-range U8S8 without VNNI, S8S8
# without fast signed kernels) is expected below the baseline: after every other INT8 recipe, among what a budget drops
# first. Every INT8 variant had one prior, so the catalogue's order put full-range U8S8 first: on an AVX2 Zen 3 a
# 5-minute demo tried U8S8 QDQ and QOperator and S8S8 QDQ (5.43, 5.43 and 2.45 points lost, the last at half ORT fp32's
# speed) and ran out before the 7-bit recipe that lost 0.54 at 1.41x fp32's throughput (issue 40).
TROUBLED_PRIOR = -0.4


def int8_kernel(variant) -> Int8Kernel | None:
    """The INT8 product a variant runs: what its chain's last quantizer holds (``Pass.int8_kernel``), as its runtime
    runs it (``Runtime.int8_kernel``); None for a float variant or kernels nobody can tell."""
    quantized = None
    for name, params in variant.chain:
        step = get_pass(name)
        quantized = step.int8_kernel(step.read_params(params)) or quantized
    return get_runtime(variant.runtime).int8_kernel(quantized, variant.options) if quantized else None


def _setting(runtime: str, cpu: CpuFeatures) -> dict[str, str]:
    """What a history row was measured under besides the CPU's features: the runtime's library versions
    (``variants.measured_with``), and the machine (``variants.machine_signature``) when ``cpu`` is this machine's."""
    try:
        libraries = json.dumps(measured_with(runtime), sort_keys=True)
    except UserError:  # a runtime no longer registered (a plugin gone): its rows match no current one
        libraries = "unknown"
    return {"libraries": libraries, **({"machine": machine_signature()} if cpu == cpu_features() else {})}


def _current(row: dict, family: str, cpu: CpuFeatures) -> bool:
    """Whether a history row speaks for ``family`` on this CPU's features with today's machine and libraries (rows
    written before they were recorded count for their features alone)."""
    if row.get("family") != family or row.get("cpu") != _signature(cpu):
        return False
    if "runtime" not in row:
        return True
    now = _setting(row["runtime"], cpu)
    return all(row.get(k) == v for k, v in now.items() if k in row)


def learned(family: str, cpu: CpuFeatures) -> dict[str, float]:
    """The mean log throughput ratio to the baseline of each variant in earlier runs of ``family`` on this CPU's
    features (on this machine, with these libraries: ``_current``)."""
    sums: dict[str, list[float]] = defaultdict(list)
    for row in read_jsonl(history_path()):
        if _current(row, family, cpu) and row.get("log_ratio") is not None:
            sums[row["variant"]].append(float(row["log_ratio"]))
    return {name: sum(v) / len(v) for name, v in sums.items()}


def expected(variant, history: dict[str, float], cpu: CpuFeatures, int8_cpu: CpuFeatures | None = None) -> float:
    """A variant's expected log throughput ratio to the baseline: what earlier runs on this CPU measured, else its
    prior — below the baseline for an INT8 recipe ``int8_cpu`` (the CPU the race ranks for: this one or the poorest CPU
    target's view of it, ``Sweep.int8_cpu``) computes wrongly or slowly, and no more than its prior there for bf16 or
    fp16 arithmetic this CPU has and that one lacks (a 5-minute demo on a Zen 4 with AVX512-BF16 and an AVX2 target
    measured ``ov-bf16-throughput`` second, on its history here, and ran out before any INT8 under load, 2026-11-29)."""
    if variant.is_baseline:
        return math.inf
    value = history[variant.name] if variant.name in history else prior(variant.name, variant.group, cpu)
    there = int8_cpu or cpu
    if ("bf16" in variant.name and cpu.bf16 and not there.bf16) or ("fp16" in variant.name and cpu.fp16 and not there.fp16):
        value = min(value, prior(variant.name, variant.group, there))
    return min(value, TROUBLED_PRIOR) if there.int8_trouble(int8_kernel(variant)) else value


def _ranked(units: list, family: str, cpu: CpuFeatures, int8_cpu: CpuFeatures | None = None) -> list[tuple[object, float]]:
    """(unit, expected value) in the race's order: the baseline first, then highest value first; ties keep the order."""
    history = learned(family, cpu)
    return sorted(((u, expected(u.variant, history, cpu, int8_cpu)) for u in units), key=lambda uv: -uv[1])


def order(units: list, family: str, cpu: CpuFeatures, int8_cpu: CpuFeatures | None = None) -> list:
    """Units (anything with a ``variant``) in the order to measure them: the baseline first (every ratio needs it),
    then by expected value, highest first; ties keep the catalogue's order."""
    return [u for u, _ in _ranked(units, family, cpu, int8_cpu)]


def likely_first(units: list, family: str, cpu: CpuFeatures, int8_cpu: CpuFeatures | None = None) -> tuple[list, list]:
    """``units`` in the race's order, split into those expected to be at least as fast as the baseline (the baseline
    with them) and the rest. A racing sweep refines the likely ones' quality before it measures the rest, so a time
    budget that runs out drops a PyTorch or fp16-without-fp16 variant, not the recovery of the likely winner."""
    ranked = _ranked(units, family, cpu, int8_cpu)
    return [u for u, v in ranked if v >= 0.0], [u for u, v in ranked if v < 0.0]


def learned_seconds(family: str, cpu: CpuFeatures) -> dict[str, float]:
    """The latest wall seconds (build and measurement) each variant of ``family`` took on this CPU's features."""
    out: dict[str, float] = {}
    for row in read_jsonl(history_path()):
        if _current(row, family, cpu) and row.get("seconds") is not None:
            out[row["variant"]] = float(row["seconds"])
    return out


# One batch call of the image demo's ort-fp32 (32 images at 263/s, 2 cores of the Xeon, 2026-11-27): the model the
# passes' ``slow_seconds`` were measured on. A search evaluates the model again and again, so it takes longer in
# proportion to a call: all-mpnet-base-v2's is 5x (32 texts at 50/s), and its accuracy-aware search ran 399 s of a
# 10-minute budget planned for 65.
SLOW_SECONDS_BATCH_S = 32 / 263


def search_scale(batch_call_s: float) -> float:
    """How much longer than ``Pass.slow_seconds`` a search takes on this model: its batch call over the demo's, at
    least 1 (a smaller model's search is not planned shorter: its fixed costs stay)."""
    return max(1.0, batch_call_s / SLOW_SECONDS_BATCH_S)


def expected_seconds(variant, learned: dict[str, float], average: float, scale: float = 1.0) -> float:
    """What building and screening ``variant`` should take: its own time in an earlier run on this CPU, else this run's
    average so far plus what its passes (``Pass.slow_seconds``, times ``scale``: ``search_scale`` of the model) and its
    runtime's options (``Runtime.extra_seconds``) are known to add."""
    if variant.name in learned:
        return learned[variant.name]
    slow = sum(get_pass(name).slow_seconds for name, _ in variant.chain) * scale
    return average + slow + get_runtime(variant.runtime).extra_seconds(variant.options)


def refinement_groups(units: list, family: str, cpu: CpuFeatures,
                      int8_cpu: CpuFeatures | None = None) -> list[tuple[tuple[str | None, str | None], list]]:
    """Refinement units (``variant.refines``) grouped by the variant they refine and their kind of node, the groups
    in the race's order (a group goes where its most promising unit would), each group in the catalogue's order
    (cheapest first), a recipe ``int8_cpu`` computes wrongly or slowly last in it. Measuring the likely winner's
    recovery first lets it show a slower base hopeless."""
    groups: dict[tuple[str | None, str | None], list] = {}
    for u in units:
        groups.setdefault((u.variant.refines, u.kind), []).append(u)
    rank = {id(u): i for i, u in enumerate(order(units, family, cpu, int8_cpu))}
    troubled = {id(u) for u in units if (int8_cpu or cpu).int8_trouble(int8_kernel(u.variant))}
    return [(key, sorted(group, key=lambda u: id(u) in troubled))
            for key, group in sorted(groups.items(), key=lambda kv: min(rank[id(u)] for u in kv[1]))]


def remember(family: str, cpu: CpuFeatures, records: list[Record], baseline: str, seconds: dict[str, float] | None = None) -> None:
    """Append this run's throughput ratios (and the wall seconds each variant took to build and screen, which a time
    budget plans with) to the history that orders the next run of the same family on this CPU."""
    by_name = {r.name: r for r in records if r.status == "ok" and r.batch_ips}
    base = by_name.get(baseline)
    if base is None or not base.batch_ips:
        return
    history_path().parent.mkdir(parents=True, exist_ok=True)
    for r in by_name.values():
        row = {"family": family, "cpu": _signature(cpu), "variant": r.name, "log_ratio": round(math.log(r.batch_ips / base.batch_ips), 4),
               "runtime": r.runtime, **_setting(r.runtime, cpu)}
        if seconds and r.name in seconds:
            row["seconds"] = round(seconds[r.name], 1)
        append_jsonl(history_path(), row)


AXES_SECONDS = 12.0  # a text encoder's batch × length grid and length batching, for one pick (MiniLM, 2 AVX2 cores)
# Settling a tie the interleaved rounds left (``Sweep.settle_ties``): the pick and this many rivals take turns block by
# block for at most this long per speed figure (the text demo's 20 % p50 gap was settled in 10-15 pairs, about 1 s; a
# batch figure within a few % stays undecided and takes the whole time), plus loading them. Under a time budget the
# duel takes what is left (the finish reserves nothing for it: a 3-minute image race then measured no INT8 variant),
# and none under DUEL_MIN_SECONDS a figure.
DUEL_RIVALS = 2
DUEL_SETTLE_ROUNDS = 2  # duel jobs per run: a duel can move a pick, and the new pick's close calls get one more
DUEL_SECONDS_PER_FIGURE = 8.0
DUEL_LOAD_SECONDS = 4.0
DUEL_MIN_SECONDS = 2.0


# The instance's answer (issue 32): each target's candidates at 1, 2, … cores (``bench.scaling``: 3 rounds × cores × two
# figures of SCALING_SECONDS each, per candidate), and the pick's capacity within the SLO, served (``serve.capacity``:
# a configuration's search takes 15-25 s here; at most CAPACITY_SECONDS, none when the budget leaves under the minimum).
SCALING_SECONDS = 0.3
# what serve.capacity's search reports, in its cache key: 2 = confirmed a headroom below the knee (a capacity stored by
# the search before it, at the knee's edge, is searched again); 3 = a step missed in its tail alone is run again;
# 4 = the search starts from the batch bound that fits the SLO (serve.capacity.slo_max_batch); 5 = a confirmation met
# by a hair runs again (a rule since removed); 6 = a failing step the knee closes in on runs again; 7 = 5 % headroom;
# 8 = the user's requests, latency from the schedule, LoadGen's early-stopping claim, no rerun of a miss (issue 42);
# 9 = a step too short to claim is not a miss, steps up to 12 s; 10 = a step meets on its plain percentile, the
# figure is the majority of up to three 20 s confirming runs (the independent check's equal)
CAPACITY_METHOD = 10
# a search's cap where the budget leaves more: a confirmation (two or three 20 s runs) that steps down once, and a
# slower model's steps (an ImageNet EfficientNet-Lite0 at ~200/s here spent 45 s of 60 without confirming)
CAPACITY_SECONDS = 150.0
# what a budget keeps for a capacity search: one configuration's (bracket and bisect, 15-25 s for the demos; two 20 s
# confirming runs, and two more a rate down) and its server's start; the search uses whatever more the budget leaves,
# up to CAPACITY_SECONDS. The image demo's INT8 pick's search ran out one 20 s run short of a majority after 92 s
# (2026-11-29, Zen 4); with 40 s kept the text demo's ran out before any rate was confirmed (2026-11-28, Xeon)
CAPACITY_RESERVE_SECONDS = 100.0
CAPACITY_MIN_SECONDS = 10.0
CAPACITY_PICKS = 2  # picks served per target: the first, and the one its served capacity may make the pick


def instance_seconds(candidates: int, cores: int, priced: int, call_s: float = 0.0) -> float:
    """What measuring the instance's answer costs: the candidates' scaling (plus opening their sessions) and the
    priced targets' capacity searches. ``call_s``: one batch call on one thread (every point of the scaling makes at
    least one: a 12-layer encoder's take seconds, not ``SCALING_SECONDS``)."""
    scaling = candidates * (3 * cores * 2 * max(SCALING_SECONDS, call_s) + 2.0) if candidates else 0.0
    return scaling + priced * CAPACITY_RESERVE_SECONDS


def closing_seconds(targets: int) -> float:
    """The very end of a sweep: the picks' profiles and the report (the image demo's two profiles and report took 2-4 s
    on 2 cores, 2026-11-27; 5 s a target had kept a 5-minute demo's capacity search from running)."""
    return targets * 3.0 + 5.0


def remeasure_seconds(rec: Record, protocol) -> float:
    """One variant's turn in a side-by-side round under ``protocol`` (``bench.protocol.Protocol``), from its screening
    figures: each phase runs its minimum time or its minimum calls, whichever is longer, after its warm-up calls. A
    small CNN's turn is the minimum times (3 s); MPNet's batch phase alone is 8 calls of 32 texts (15-20 s on 2 cores)."""
    call = rec.latency_ms.p50 / 1000 if rec.latency_ms is not None and rec.latency_ms.p50 else 0.0
    batch = (protocol.batch_size / rec.throughput_ips.batch
             if rec.throughput_ips is not None and rec.throughput_ips.batch else 0.0)
    latency = min(protocol.max_seconds, max(protocol.min_seconds, protocol.min_runs * call)) + protocol.warmup * call
    return latency + min(protocol.max_seconds, max(protocol.batch_min_seconds, protocol.batch_min_runs * batch)) + batch


def finish_estimate(rounds: int, targets: int, contenders: int | None = None, axes: bool = False,
                    remeasured: int | None = None, per_round: float = 4.0, capped: int = 0) -> float:
    """Seconds the end of a sweep takes after the last screening: cold starts of a few contenders, the side-by-side
    re-measure of up to three candidates per target computing on a CPU (``remeasured`` of the ``targets``: a server
    CPU's and an edge device's; a GPU target's figures are not re-measured here) with the baseline (two phases of 1.5 s and a load each), profiles of the picks,
    the report; with ``axes``, the family's own axes of each target's pick and the baseline. ``contenders``: how many
    variants besides the baseline could be re-measured (a budgeted run that has measured three reserves for three, not
    for the catalogue). ``per_round``: one candidate's turn in a round (``remeasure_seconds`` of the baseline, which
    every re-measure runs and the candidates rarely trail by much). ``capped``: re-measures held to a target's poorer
    instruction set, each another side-by-side run (MPNet's pair took 2 rounds of 46 s each)."""
    per = 3 * max(1, targets if remeasured is None else remeasured)
    candidates = min(6, per, contenders if contenders is not None else 6) + 1
    return (min(4, candidates) * 4.0 + (1 + capped) * candidates * rounds * per_round + closing_seconds(targets)
            + (AXES_SECONDS * (min(targets, candidates) + 1) if axes else 0.0))


def tuning_view(rec: Record) -> Record:
    """``rec`` as judged on the tuning samples (its ``tuning_quality`` as ``quality``): what a choice may read, so the
    held-out quality the verdict reads stays unseen. Unchanged where it has none (a record from before)."""
    return rec if rec.tuning_quality is None else rec.model_copy(update={"quality": rec.tuning_quality})


def misses_quality(target: Target, rec: Record, ref: Record | None, family: Family, on_tuning: bool = False) -> bool:
    """Whether ``rec`` fails one of the target's quality bounds; ``on_tuning``: judged on the tuning samples where
    both records have them (``tuning_view``), as every choice is."""
    if on_tuning and rec.tuning_quality is not None and ref is not None and ref.tuning_quality is not None:
        rec, ref = tuning_view(rec), tuning_view(ref)
    return any(b.status == "fail" for b in judge(target, rec, ref, family).bounds if b.kind == "quality")


def beats(target: Target, a: Record, b: Record, ref: Record | None, family: Family, here_isa: str | None = None,
          noise: bool = True, drift: float = DRIFT) -> str | None:
    """Why ``a`` beats ``b`` for ``target`` beyond noise (the 95 % intervals widened by ``drift``) on everything the
    target asks for, or None. ``noise=False``: on the point figures alone (who is ahead, not who is surely ahead)."""
    if a.name == b.name or not (eligible(target, a) and eligible(target, b)):
        return None
    # A target held to a poorer instruction set than this machine's: a runtime that will be capped may slow down, so
    # only figures that stand uncapped can beat (a capped loser only gets slower).
    if target.isa is not None and richer(here_isa, target.isa) and get_runtime(a.runtime).isa_cap_env(target.isa) is not None:
        return None
    va, vb = judge(target, a, ref, family), judge(target, b, ref, family)
    miss_a = {x.bound: x.miss or 0.0 for x in va.bounds if x.kind in DETERMINISTIC}
    miss_b = {x.bound: x.miss or 0.0 for x in vb.bounds if x.kind in DETERMINISTIC}
    if any(miss_a.get(k, 0.0) > miss_b.get(k, 0.0) for k in miss_a):
        return None
    why = []
    for dim in speed_dims(target):
        ia, ib = interval(a, dim, drift), interval(b, dim, drift)
        if ia is None or ib is None:
            return None
        if not noise:
            ia, ib = point(a, dim), point(b, dim)
        if not clears(dim, ia, ib):
            return None
        unit = "ms p50" if dim == "p50_ms" else "/s"
        fig = (a.p50_ms, b.p50_ms) if dim == "p50_ms" else (a.batch_ips, b.batch_ips)
        why.append(f"{fig[0]:.4g} vs {fig[1]:.4g} {unit}")
    return f"{target.name}: {a.name} is ahead beyond noise ({'; '.join(why)}) and meets every quality and size bound it does"


def screened_out(targets: list[Target], records: list[Record], ref: Record | None, family: Family, keep: set[str],
                 here_isa: str | None = None, drift: float = SCREENING_DRIFT) -> dict[str, str]:
    """Variants beaten beyond noise for every target they could serve, each with what beat it. ``keep`` (the original
    and the baseline) are never screened out: every figure is compared with them. Beyond noise: the intervals widened
    by ``drift``, by default the one the decision selects its side-by-side candidates with (``noise.SCREENING_DRIFT``):
    a variant it could select could be picked, so the race screens out nothing ``--full`` would pick."""
    here_isa = here_isa or str(_measuring_level(records))
    ok = [r for r in records if r.status == "ok"]
    screened: dict[str, str] = {}
    for b in ok:
        if b.name in keep:
            continue
        mine = [t for t in targets if eligible(t, b)]
        reasons = []
        for t in mine:
            why = next((w for a in ok if (w := beats(t, a, b, ref, family, here_isa, drift=drift))), None)
            if why is None:
                break
            reasons.append(why)
        else:
            if mine:
                screened[b.name] = "screened out — " + " | ".join(reasons)
    return screened


def beaten_even_if_recovered(targets: list[Target], base: Record, records: list[Record], ref: Record | None,
                             family: Family) -> str | None:
    """Why refining ``base``'s quality cannot help: with the original's quality assumed, its kernels are still beaten
    beyond noise for every target (a refinement runs the same kernels, or slower ones). None: it might win."""
    if base.status != "ok" or ref is None or base.latency_ms is None:
        return None
    perfect = _recovered(base, ref)
    others = [r for r in records if r.name != base.name]
    return screened_out(targets, [*others, perfect], ref, family, keep=set(), drift=DRIFT).get(base.name)


def challengers(targets: list[Target], base: Record, records: list[Record], ref: Record | None, family: Family) -> list[str]:
    """The variants that would make refining ``base`` hopeless if their lead held beyond noise: for each target where
    nothing beats ``base`` (its quality assumed recovered) beyond noise, the one ahead of it on the point figures that
    does best on the target's objective. Measured again with longer phases (narrower intervals) with ``base``, they
    settle whether a long refinement is worth building."""
    if base.status != "ok" or ref is None or base.latency_ms is None:
        return []
    perfect = _recovered(base, ref)
    ok = [r for r in records if r.status == "ok" and r.name != base.name]
    isa = str(_measuring_level(records))
    names: list[str] = []
    for t in targets:
        if not eligible(t, perfect) or any(beats(t, a, perfect, ref, family, isa) for a in ok):
            continue
        ahead = [a for a in ok if beats(t, a, perfect, ref, family, isa, noise=False)]
        if ahead:
            best = max(ahead, key=lambda r: -(r.p50_ms or math.inf) if t.objective == "latency" else (r.batch_ips or 0.0))
            names.append(best.name)
    return list(dict.fromkeys(names))


def beaten_side_by_side(targets: list[Target], base: Record, side: dict[str, SideBySide], records: list[Record],
                        ref: Record | None, family: Family, margin: float = SIDE_MARGIN) -> str | None:
    """Why refining ``base`` cannot help, from a side-by-side run of ``base`` and its challengers (``side``: their
    per-round figures, same process, alternated): for every target ``base`` could serve, something beats it there with
    its quality assumed recovered — beyond noise on the screening figures, or a challenger meeting every bound ``base``
    would, ahead by ``margin`` on each of the target's speed figures in every side-by-side round. Same-run rounds need
    no allowance for drift between two moments, which the screening figures do (and which kept a 1.27x throughput lead
    from counting). None: it might win."""
    if base.status != "ok" or ref is None or base.name not in side:
        return None
    perfect = _recovered(base, ref)
    ok = {r.name: r for r in records if r.status == "ok" and r.name != base.name}
    isa = str(_measuring_level(records))
    mine, reasons = side[base.name], []
    for t in (t for t in targets if eligible(t, perfect)):
        why = next((w for a in ok.values() if (w := beats(t, a, perfect, ref, family, isa))), None) or next(
            (f"{t.name}: {name} is ahead by more than {margin:.0%} in each of {len(sb.p50_ms_rounds)} side-by-side rounds "
             f"({sb.p50_ms:.4g} vs {mine.p50_ms:.4g} ms p50; {sb.throughput_ips:.4g} vs {mine.throughput_ips:.4g} /s) and "
             "meets every quality and size bound it would"
             for name, sb in side.items()
             if name in ok and beats(t, ok[name], perfect, ref, family, isa, noise=False)
             and ahead_every_round(speed_dims(t), sb, mine, margin)), None)
        if why is None:
            return None
        reasons.append(why)
    return " | ".join(reasons) or None


def _recovered(base: Record, ref: Record) -> Record:
    """``base`` with the original's quality: what a refinement that recovers its quality could at best be."""
    return base.model_copy(update={"quality": ref.quality})


def _measuring_level(records: list[Record]):
    env = next((r.environment for r in records if r.environment), None)
    return env.isa if env else cpu_features().level


def cap_changes(names: list[str], records: list[Record], isa: Isa) -> bool:
    """Whether a capped re-measure can change anything: some candidate's runtime can be held to ``isa`` (ONNX
    Runtime's cannot: its figures would only be measured again, about 40 s of a demo sweep for nothing)."""
    by_name = {r.name: r for r in records}
    return any(n in by_name and get_runtime(by_name[n].runtime).isa_cap_env(isa) is not None for n in names)


# A refinement ladder (``Sweep._refine``) skips its searches (passes with ``slow_seconds``: the accuracy-aware ones, the
# calibration search; minutes each, the longest builds of a sweep: 7 minutes past a 10-minute budget on MPNet) once this
# many rungs were tried and the best of them (or the variant they refine) still loses more than this many times the
# tolerated drop: what a search can still recover with INT8 kernels is a calibration's or a few layers' worth, not
# several tolerances. The cheap rungs (other calibrations, equalization, bias correction: seconds) are all tried.
REFINE_GIVE_UP_AFTER = 2
REFINE_GIVE_UP_FACTOR = 3.0


# The same for the verification gate, in units of what the gate allows (``Family.gate_shortfall``), read on the tuning
# samples like every choice. A variant that failed the gate has no drop the targets read, so the points rule never fires
# on it. Where a rung comes near, the search goes on: on 320 natural-image crops a real ImageNet EfficientNet-Lite0
# hesitates over (median top-1 p 0.21), the cheap rungs agreed 75-76 % on the tuning crops but NNCF with bias
# correction 89.9 % (0.01 short), so the searches were built (5 minutes: 74.7-81 % on tuning, 64-72 % held out).
REFINE_GATE_GIVE_UP = 2.0


def refinement_hopeless(drops: list[float | None], tolerance: float, tried: int,
                        shortfalls: list[float | None] | None = None) -> str | None:
    """Why a search on a refinement ladder is not worth building, or None: ``drops``, the points lost by the variant
    refined and by each rung tried (None: not measured), ``tried`` rungs so far, ``tolerance`` the tightest
    ``max_accuracy_drop`` of its targets; ``shortfalls``: how far each missed the verification gate, in units of its
    allowance (``Family.gate_shortfall``; a variant that failed the gate has no drop the targets read)."""
    gaps = [g for g in shortfalls or [] if g is not None]
    if tried >= REFINE_GIVE_UP_AFTER and gaps and len(gaps) == len(shortfalls or []) and min(gaps) > REFINE_GATE_GIVE_UP:
        return (f"after {tried} refinements the closest still misses the verification gate by {min(gaps):.1f}× what it "
                f"allows (more than {REFINE_GATE_GIVE_UP:g}×): a search cannot plausibly recover that with INT8 kernels "
                "(--full builds it)")
    known = [d for d in drops if d is not None]
    if tried < REFINE_GIVE_UP_AFTER or not known or tolerance <= 0:
        return None
    best = min(known)
    if best <= REFINE_GIVE_UP_FACTOR * tolerance:
        return None
    return (f"after {tried} refinements the best still loses {best:.2f} points, more than {REFINE_GIVE_UP_FACTOR:g}× the "
            f"{tolerance:g} tolerated: a search cannot plausibly recover that with INT8 kernels (--full builds it)")
