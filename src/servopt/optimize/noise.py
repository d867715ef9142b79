"""What counts as a difference on this machine: one rule for the race's screening and the decision's ties.

The race screens with the drift the decision selects its side-by-side candidates with (``SCREENING_DRIFT``): what
could be among them could be picked, so screening it out would change the answer.

Two figures of a shared 2-core machine differ for reasons that are not the variants: the 95 % interval of a median
covers one measurement, and two moments of the machine drifted apart by up to ``DRIFT`` on top of it
(docs/protocol.md). Side by side (same process, alternated rounds) the drift cancels round by round, and a lead counts
when most rounds agree and the medians are further apart than one round moves (``SIDE_NOISE``), or, with enough
rounds, when every round agrees and the lead is large enough to matter (``TIE_GAP``: the margin within which the issue
tracker, and a user pricing instances, call two variants equally fast). Rounds are seconds apart; where they leave a
tie, a duel (``bench.duel``: turns every few tens of milliseconds) settles it, and its verdict counts instead.
"""

from __future__ import annotations

import math

from servopt.contracts import Duel, Record, SideBySide

# Two measurements of the same variant at two moments of this shared machine differed by up to this factor on top of
# their confidence intervals (docs/protocol.md): a win smaller than that is not a win.
DRIFT = 1.10
# Side by side, a lead smaller than this is not worth a more complex recipe (and 6 rounds here cannot resolve it:
# the same pair measured +2.8 % and -8.3 % in two runs, docs/benchmarks.md).
TIE_GAP = 0.03
# Which variants deserve the side-by-side re-measure: those within this factor of the leader on a sweep's figures,
# beyond the 95 % intervals. The image demo's same-kernel INT8 variants (one graph, other calibration scales) measured
# 3.45 and 5.51 ms p50 (305 and 196 img/s) in one full sweep on 2026-11-27, no interference flagged: between two
# moments this machine drifts far more than DRIFT, and a contender left out of the re-measure cannot be picked.
SELECTION_DRIFT = 1.6
# What the race may screen out: beaten beyond the intervals widened by the drift the decision selects its side-by-side
# candidates with. A variant within SELECTION_DRIFT of the leader goes to the side-by-side re-measure in a full sweep,
# where it may be found tied and picked as the simpler recipe; screened out at DRIFT (the image demo's 5.51 ms INT8
# variant against 3.45 ms), the race picked something else than ``--full``.
SCREENING_DRIFT = SELECTION_DRIFT

# Between two variants of the same speed, one side-by-side round's ratio ranged this far (the image demo's INT8
# variants, 3-round re-measures: 2-20 % on a batch-1 p50 in one run), and their medians stayed within it (7.6 %). With
# fewer than SIGN_ROUNDS rounds, a lead in every round means little (three rounds all one way happen by chance one
# time in eight): a lead counts when the medians are this far apart, most rounds agreeing.
SIDE_NOISE = 0.10
SIGN_ROUNDS = 5  # all rounds one way by chance: 1 in 32
# Two rounds only (a capped re-measure the budget cut short): a lead counts in both rounds and by twice what one round
# moves. Without it two rounds told nothing apart: the image demo's avx2-capped rounds had ov-int8-qdq at 1.34x
# ort-fp32's batch throughput in both, "as near within noise", and the simplest recipe, ort-fp32, became cpu-server's
# nearest (a 5-minute demo, AMD EPYC Zen 4, 2026-11-29)
TWO_ROUND_LEAD = 2 * SIDE_NOISE


def interval(rec: Record, what: str, drift: float = DRIFT) -> tuple[float, float] | None:
    """(pessimistic, optimistic) ends of a speed figure: p50 in ms (high, low) or batch throughput (low, high), from
    the 95 % interval of the median the protocol computes, widened by ``drift`` between two moments."""
    if what == "p50_ms":
        lat = rec.latency_ms
        if lat is None:
            return None
        lo, hi = (lat.p50_ci95 or [lat.p50, lat.p50])[:2]
        return hi * drift, lo / drift
    thr, lat = rec.batch_ips, rec.batch_latency_ms
    if not thr:
        return None
    lo, hi = (lat.p50_ci95 if lat and lat.p50_ci95 and lat.p50 else [lat.p50, lat.p50] if lat else [1.0, 1.0])[:2]
    p50 = lat.p50 if lat and lat.p50 else 1.0
    return thr * p50 / hi / drift, thr * p50 / lo * drift  # throughput moves inversely with the batch's latency


def point(rec: Record, what: str) -> tuple[float, float]:
    """A speed figure as a zero-width interval (pessimistic end, optimistic end)."""
    x = rec.p50_ms if what == "p50_ms" else rec.batch_ips
    return float(x or 0.0), float(x or 0.0)


def points_apart(what: str, a: Record, b: Record) -> float:
    """How many times ``a``'s point figure is better than ``b``'s (below 1: worse; inf where ``b`` has none)."""
    fa, fb = point(a, what)[0], point(b, what)[0]
    if not fa or not fb:
        return math.inf if fa and not fb else 0.0
    return fb / fa if what == "p50_ms" else fa / fb


def clears(what: str, a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether interval ``a``'s pessimistic end is ahead of ``b``'s optimistic end (lower p50, higher throughput)."""
    return a[0] < b[1] if what == "p50_ms" else a[0] > b[1]


def ahead_every_round(dims: list[str] | tuple[str, ...], a: SideBySide, b: SideBySide, margin: float) -> bool:
    """``a`` ahead of ``b`` by ``margin`` on each speed figure in each of at least three side-by-side rounds."""
    if len(a.p50_ms_rounds) < 3 or len(a.p50_ms_rounds) != len(b.p50_ms_rounds):
        return False
    p50 = "p50_ms" not in dims or all(x <= (1 - margin) * y for x, y in zip(a.p50_ms_rounds, b.p50_ms_rounds, strict=True))
    tp = "throughput_ips" not in dims or all(x >= (1 + margin) * y for x, y in zip(a.throughput_rounds, b.throughput_rounds, strict=True))
    return p50 and tp


def rounds_won(what: str, a: SideBySide, b: SideBySide) -> tuple[int, int]:
    """(rounds ``a`` was ahead of ``b`` on ``what``, rounds both ran)."""
    xs, ys = (a.p50_ms_rounds, b.p50_ms_rounds) if what == "p50_ms" else (a.throughput_rounds, b.throughput_rounds)
    n = min(len(xs), len(ys))
    won = sum(1 for x, y in zip(xs[:n], ys[:n], strict=True) if (x < y if what == "p50_ms" else x > y))
    return won, n


def gap(what: str, a: float, b: float) -> float:
    """How far ``a`` is ahead of ``b`` as a share of ``b`` (negative: behind)."""
    return (b - a) / b if what == "p50_ms" else (a - b) / b


def surely_ahead_side_by_side(what: str, a: SideBySide, b: SideBySide) -> bool:
    """Side by side (at least three rounds), ``a`` counts as faster than ``b``: ahead in most rounds and by
    ``SIDE_NOISE`` or more on the medians (beyond what one round moves), or, with ``SIGN_ROUNDS`` rounds or more, ahead
    in every round and by ``TIE_GAP`` or more on the medians; with two rounds, ahead in both by ``TWO_ROUND_LEAD``."""
    won, n = rounds_won(what, a, b)
    fa = a.p50_ms if what == "p50_ms" else a.throughput_ips
    fb = b.p50_ms if what == "p50_ms" else b.throughput_ips
    lead = gap(what, fa, fb)
    if n == 2:
        return won == 2 and lead >= TWO_ROUND_LEAD
    if n < 3 or won <= n / 2:
        return False
    return lead >= SIDE_NOISE or (n >= SIGN_ROUNDS and won == n and lead >= TIE_GAP)


def duel_ahead(duel: Duel, name: str) -> bool:
    """Whether a duel (``bench.duel``: block by block, the pair's drift cancelled) found ``name`` ahead beyond noise
    by ``TIE_GAP`` or more; a tie or an undecided duel says neither is."""
    return duel.verdict == ("a" if duel.a == name else "b")


def duel_lead(duel: Duel, name: str) -> float:
    """How far ``name`` is ahead of the other in a duel, as a share (negative: behind); on a throughput figure too,
    since a batch's time per call is what the throughput inverts."""
    ratio = duel.time_ratio if duel.a == name else 1 / duel.time_ratio
    return 1 / ratio - 1
