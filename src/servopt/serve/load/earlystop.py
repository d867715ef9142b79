"""How many queries a latency percentile claim needs: MLPerf LoadGen's early-stopping rule (``loadgen/early_stopping.cc``,
its server scenario).

A step's answers are ``n`` queries of which ``t`` took longer than the bound. Read as independent trials, the claim
"the ``p``-th percentile is within the bound" holds at ``confidence`` when a server whose true share of answers within
the bound were only ``p`` would give at most ``t`` over-bound answers in ``n`` with probability at most
``1 - confidence``: ``P(Binomial(n, 1 - p) <= t) <= 1 - confidence``. ``min_passing(t)`` is the least number of
within-bound answers ``h`` for which ``n = h + t`` makes the claim; with no answer over the bound a p99 claim at 99 %
needs 459 queries (``ceil(log 0.01 / log 0.99)``), at 95 % 299. Fewer queries claim nothing, whatever their
percentile: "the p99 of 200 queries" is their second-worst answer, and says little about the next 200.

Hand-written (a binomial tail in log space) because the client side of ``servopt[serve]`` does not
carry SciPy; ``tests/test_load.py`` checks it against ``scipy.stats.binom``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

CONFIDENCE = 0.99  # LoadGen's


def binomial_cdf(t: int, n: int, q: float) -> float:
    """``P(X <= t)`` for ``X ~ Binomial(n, q)``: the terms in log space, each from the one before
    (``pmf(x + 1) / pmf(x) = (n - x) / (x + 1) * q / (1 - q)``), so a tail of ``t`` terms costs ``t`` steps."""
    if t >= n or q <= 0:
        return 1.0
    if q >= 1:
        return 0.0
    ratio = math.log(q) - math.log1p(-q)
    term = n * math.log1p(-q)  # log pmf(0)
    terms = [term]
    for x in range(t):
        term += math.log(n - x) - math.log(x + 1) + ratio
        terms.append(term)
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(v - top) for v in terms))


@lru_cache(maxsize=4096)
def min_passing(t: int, percentile: float, confidence: float = CONFIDENCE) -> int:
    """The least ``h`` (answers within the bound) with which ``t`` answers over it still claim the ``percentile``
    (0.99 for p99) at ``confidence``: ``P(Binomial(h + t, 1 - percentile) <= t) <= 1 - confidence``."""
    if not 0 < percentile < 1 or not 0 < confidence < 1:
        raise ValueError(f"percentile {percentile} and confidence {confidence} must be within (0, 1)")
    q = 1 - percentile

    def passes(h: int) -> bool:
        return binomial_cdf(t, h + t, q) <= 1 - confidence

    # never fewer than t = 0's answer, nor than the h whose mean over-bound count, (h + t) q, is t
    lo = max(1, math.ceil(math.log(1 - confidence) / math.log(percentile)), int(t * percentile / q))
    hi = lo
    while not passes(hi):
        hi = int(hi * 1.25) + 1
    while lo < hi:  # the tail falls as h grows: bisect for the first h that passes
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def queries_for(over: int, percentile: float, confidence: float = CONFIDENCE) -> int:
    """The queries a step must answer to claim ``percentile`` at ``confidence`` with ``over`` of them over the bound."""
    return min_passing(over, percentile, confidence) + over


def most_over(n: int, percentile: float, confidence: float = CONFIDENCE) -> int | None:
    """The most answers over the bound ``n`` queries can carry and still claim ``percentile`` (None: not even none).
    ``queries_for`` grows with the answers over the bound: bisected."""
    if queries_for(0, percentile, confidence) > n:
        return None
    lo, hi = 0, int(n * (1 - percentile))  # h >= t p / (1 - p) and h + t <= n: t <= n (1 - p)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if queries_for(mid, percentile, confidence) <= n:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Claim:
    """What a step's answers say of a latency percentile within ``bound_ms``."""

    queries: int  # answers counted (every query sent: one not answered within the bound is over it)
    over: int  # over the bound (or not answered at all)
    needed: int  # the queries the claim needs with ``over`` of them over the bound
    holds: bool  # queries >= needed: the percentile is within the bound at the confidence
    estimate_ms: float | None  # the early-stopping estimate: the latency at most ``allowed`` answers exceeded
    allowed: int | None  # the most over-bound answers ``queries`` could carry and still claim (None: not even none)
    confidence: float

    @property
    def too_few(self) -> bool:
        """Not even an answer-free step of this length claims anything."""
        return self.allowed is None


def claim(latencies_ms: list[float], unanswered: int, bound_ms: float, percentile: float,
          confidence: float = CONFIDENCE) -> Claim:
    """LoadGen's server-scenario claim over a step's answers (``unanswered``: queries with no answer in time, errors
    and refusals, each counted over the bound). ``estimate_ms``: the latency at rank ``allowed + 1`` from the top,
    where ``allowed`` is the most answers over any bound ``n`` queries can carry and still claim the percentile; the
    claim holds exactly when that estimate is within the bound."""
    n = len(latencies_ms) + unanswered
    over = sum(1 for v in latencies_ms if v > bound_ms) + unanswered
    needed = queries_for(over, percentile, confidence)
    allowed = most_over(n, percentile, confidence)
    estimate = None
    if allowed is not None and allowed < n:
        ranked = sorted(latencies_ms, reverse=True)
        rank = allowed - unanswered  # the unanswered are the worst of all
        estimate = math.inf if rank < 0 else ranked[rank] if rank < len(ranked) else None
    return Claim(queries=n, over=over, needed=needed, holds=n >= needed, estimate_ms=estimate, allowed=allowed,
                 confidence=confidence)
