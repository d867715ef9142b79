"""What the sweep measures again after the race, chosen from the sweep's figures: the Pareto front, the candidates
re-measured side by side per target (``interleave_candidates``), and the close calls a duel settles (``unsettled``).
Pure functions of records and targets, like the decision they feed (``decide``)."""

from __future__ import annotations

from servopt.contracts import Interleaved, Record
from servopt.families.base import Family
from servopt.machine import Device
from servopt.optimize.decide import (
    Verdict,
    decide,
    eligible,
    for_target,
    judge,
    no_worse_fixed,
    objective_dim,
    objective_key,
    simplicity,
    speed_dims,
    surely_ahead,
)
from servopt.optimize.noise import SELECTION_DRIFT, points_apart
from servopt.optimize.targets import Target


def pareto_front(records: list[Record], ref: Record | None, family: Family) -> list[str]:
    """Variants no other variant beats on all of p50, batch throughput, size and accuracy."""
    pts = []
    for r in records:
        if r.status != "ok" or r.needs_gpu:
            continue
        drop = family.quality_drop(r, ref)
        if drop is None or r.p50_ms is None or r.batch_ips is None or r.size_mb is None:
            continue
        pts.append((r.name, (r.p50_ms, -r.batch_ips, r.size_mb, drop)))

    def dominates(a: tuple, b: tuple) -> bool:
        return all(x <= y for x, y in zip(a, b, strict=True)) and any(x < y for x, y in zip(a, b, strict=True))

    return [n for n, p in pts if not any(dominates(q, p) for _, q in pts)]


def _far_behind(t: Target, lead: Verdict, v: Verdict, by_name: dict[str, Record]) -> bool:
    """The leader's point figures ahead of ``v``'s by more than the drift between two moments of this machine on every
    speed figure ``t`` uses: a figure timed briefly under load can have an interval too wide to rule anything out
    (PyTorch eager's p50 over 10 calls on a loaded machine: 15-261 ms), its point still says it cannot be the pick."""
    return all(points_apart(d, by_name[lead.variant], by_name[v.variant]) > SELECTION_DRIFT for d in speed_dims(t))


def interleave_candidates(targets: list[Target], records: list[Record], ref: Record | None, family: Family,
                          per_target: int = 3) -> list[str]:
    """Per target computing on a CPU (a server CPU's, and an edge device's whose figures rank its candidates here):
    the leader on the sweep's figures (passing first, else meeting the quality bounds), then the simplest of those
    within this machine's drift between two moments of it (``SELECTION_DRIFT``) — the pick if the side-by-side run
    finds them equal —, then the next fastest that the leader is not ahead of beyond the noise on every speed figure
    the target uses; re-measured side by side. (On an AVX2 Zen 3 a 5-minute demo that had measured five variants
    re-measured PyTorch eager, 7x slower than the leader, as the "next": 80 s of its budget, and 41 s more scaling it.)"""
    chosen: list[str] = []
    for t in targets:
        if t.device.computes_on is not Device.CPU:  # a GPU target's figures are not taken here
            continue
        mine = [r for r in for_target(t, records) if eligible(t, r)]
        by_name = {r.name: r for r in mine}
        verdicts = [judge(t, r, ref, family) for r in mine]
        acc_ok = [v for v in verdicts if all(b.status != "fail" for b in v.bounds if b.kind == "quality")]
        ranked = sorted(acc_ok, key=lambda v: (not v.passes, objective_key(t, v)))
        if not ranked:
            continue
        lead = ranked[0]
        peers = [v for v in ranked if v.passes == lead.passes and no_worse_fixed(v, lead)]
        near = [v for v in peers if v is lead or not (_far_behind(t, lead, v, by_name) or any(
            surely_ahead(d, lead, v, by_name, None, SELECTION_DRIFT) for d in speed_dims(t)))]
        simplest = sorted(near, key=lambda v: simplicity(by_name[v.variant]))
        within = [v for v in ranked if not _far_behind(t, lead, v, by_name)
                  and not all(surely_ahead(d, lead, v, by_name, None) for d in speed_dims(t))]
        ordered = list(dict.fromkeys(v.variant for v in [lead, *simplest, *within]))
        for name in ordered[:per_target]:
            if name not in chosen:
                chosen.append(name)
    return chosen


def unsettled(targets: list[Target], records: list[Record], ref: Record | None, family: Family, interleaved: Interleaved,
              rivals: int, most: int = 4) -> tuple[list[str], list[str]]:
    """The close calls a duel should settle: per target computing on a CPU, its pick and up to ``rivals`` variants that
    could be it — tied with it, or as good on the fixed bounds (passing where it passes; missing no quality or size
    bound by more where nothing passes) and within ``SELECTION_DRIFT`` of it on a speed figure's medians over the
    rounds (three rounds seconds apart put two equal INT8 models 20 % apart on p50 in each, 2026-11-27: a lead of the
    rounds is no more settled than a tie) —, the tied first, then the closest on the objective; each in the
    interleaved process, not alternated from an environment of its own, and **on the pick's runtime**: two runtimes'
    thread pools taking turns every 0.1 s in one process time each other's idle workers (ONNX Runtime fp32 against
    OpenVINO fp32 of a real EfficientNet-Lite0: the duel put OpenVINO 13-19 % ahead on p50 in two runs, where the
    rounds found 0.995-0.998 and each in its own process, alternating, 1.03× [0.98, 1.06]; 2026-11-28, Xeon) — such
    a close call stays as the rounds left it; ``most`` in all; and the speed figures those targets use. ([], []) when
    there is none."""
    picks: list[str] = []
    others: list[str] = []
    figures: set[str] = set()
    runtime_of = {r.name: r.runtime for r in records}

    def joined(name: str | None) -> bool:
        v = interleaved.variants.get(name or "")
        return v is not None and v.method == "interleaved"

    def apart(dim: str, pick: str, other: str) -> float:
        """How many times slower ``other`` is than ``pick`` on the rounds' medians (below 1: faster)."""
        a, b = interleaved.variants[pick], interleaved.variants[other]
        return b.p50_ms / a.p50_ms if dim == "p50_ms" else a.throughput_ips / b.throughput_ips

    for t in targets:
        if t.device.computes_on is not Device.CPU:
            continue
        d = decide(t, records, ref, family, interleaved)
        pick = d.pick
        if not joined(pick) or d.verdict is None:
            continue
        dims = speed_dims(t)
        runtime = runtime_of.get(pick)
        close = [v.variant for v in d.verdicts if v.variant != pick and joined(v.variant) and runtime_of.get(v.variant) == runtime
                 and (v.variant in d.tied or (
                 (v.passes if d.recommended else no_worse_fixed(v, d.verdict))
                 and any(apart(dim, pick, v.variant) <= SELECTION_DRIFT for dim in dims)))]
        close.sort(key=lambda n: (n not in d.tied, apart(objective_dim(t), pick, n)))
        if not close:
            continue
        picks.append(pick)
        others += close[:rivals]
        figures.update(dims)
    names = list(dict.fromkeys([*picks, *others]))[:most]  # every target's pick first; one process takes them all in turn
    return names, [f for f in ("p50_ms", "throughput_ips") if f in figures]
