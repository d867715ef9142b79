"""Rounds that take turns: every contender measured once per round, the order flipped every round, and per-round ratios
summarized as their median with the median's distribution-free interval.

The library's one round loop. The sweep's side-by-side re-measure (``bench.jobs.run_interleave``, one process), its
process-by-process one (``bench.alternate``) and ``peers.runner`` (``servopt compare``) all run theirs here, and the
benchmarks import it: a loop that never flips always runs the same
contender first, so whichever way the shared machine drifts within a round favours it every round.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from servopt.bench.stats import Z95, median_ranks
from servopt.contracts import Measured, SideBySide


def round_order(names: list[str], i: int) -> list[str]:
    """Round ``i``'s order: as given on even rounds, reversed on odd ones."""
    return list(names) if i % 2 == 0 else list(reversed(names))


@dataclass
class Rounds:
    """Each name's measurements, round by round (None once it failed), and each round's order."""

    measured: dict[str, list[Measured | None]]
    order: list[list[str]]
    failed: dict[str, str] = field(default_factory=dict)  # name → why (its first failure; not measured after)

    def noisy_rounds(self) -> list[int]:
        return [i for i in range(len(self.order))
                if any((m := ms[i]) is not None and m.interference is not None and m.interference.flagged
                       for ms in self.measured.values() if i < len(ms))]

    def flagged(self, name: str) -> int:
        return sum(1 for m in self.measured[name] if m is not None and m.interference is not None and m.interference.flagged)


def take_turns(names: list[str], rounds: int, measure: Callable[[str, int], Measured],
               progress: Callable[[str], None] = lambda _m: None) -> Rounds:
    """Every name measured once per round (``measure(name, round)``), in ``round_order``. A measurement that comes back
    failed drops its name from later rounds (its reason kept); one that raises ends the loop (the caller's way to
    stop at once: a deadline, a failure it cannot use). The first name is the reference: when it fails, no later round
    could pair with it, and the loop stops."""
    out = Rounds(measured={n: [] for n in names}, order=[])
    for i in range(rounds):
        order = [n for n in round_order(names, i) if n not in out.failed]
        out.order.append(order)
        for name in names:
            if name in out.failed:
                out.measured[name].append(None)
        for name in order:
            progress(f"round {i + 1}/{rounds}: measuring {name}")
            m = measure(name, i)
            if m.status != "ok":
                out.failed[name] = m.error or "the measurement failed"
                out.measured[name].append(None)
                continue
            out.measured[name].append(m)
        if names and names[0] in out.failed:
            break
    return out


def coverage(n: int, lo: int, hi: int) -> float:
    """The exact probability that the order statistics of ranks ``lo``..``hi`` (0-based) of ``n`` draws bracket the
    population median: P(lo < B ≤ hi + 1) with B ~ Binomial(n, 1/2) counting the draws below it."""
    return sum(math.comb(n, k) for k in range(lo + 1, hi + 1)) / 2 ** n


def ratio_interval(ratios: list[float], z: float = Z95) -> tuple[float, float, float, float]:
    """(median, low, high, coverage) of per-round ratios: the median and its binomial order-statistics interval (at
    ``z``; with few rounds the widest, the range), and that interval's exact coverage."""
    s = sorted(ratios)
    lo_i, hi_i = median_ranks(len(s), z)
    return statistics.median(s), s[lo_i], s[hi_i], coverage(len(s), lo_i, hi_i)


def per_round_ratios(a: Iterable[float | None], b: Iterable[float | None]) -> list[float]:
    """``a ÷ b`` round by round, over the rounds where both have a figure and ``b``'s is positive: each ratio pairs a
    figure with its own round's reference, so the drift between rounds cancels."""
    return [x / y for x, y in zip(a, b, strict=False) if x is not None and y is not None and y > 0]


def side_by_side(results: dict[str, list[Measured]], reference: str, anchor: SideBySide | None = None,
                 method: str = "interleaved") -> dict[str, SideBySide]:
    """Each contender's medians over rounds and its per-round ratios to ``reference`` as their median with the median's
    interval (``ratio_interval``). With ``anchor`` (the reference's figures in another same-run re-measure), a
    contender's p50 and throughput are its ratios applied to the anchor's, so figures from both rank on one scale."""
    base = results[reference]
    out = {}
    for name, ms in results.items():
        p50s, tps = [m.latency_ms.p50 for m in ms], [m.throughput_ips.batch for m in ms]
        p50_r = ratio_interval(per_round_ratios(p50s, [b.latency_ms.p50 for b in base]))
        tp_r = ratio_interval(per_round_ratios(tps, [b.throughput_ips.batch for b in base]))
        out[name] = SideBySide(p50_ms=anchor.p50_ms * p50_r[0] if anchor else statistics.median(p50s),
                               throughput_ips=anchor.throughput_ips * tp_r[0] if anchor else statistics.median(tps),
                               p50_ms_rounds=p50s, throughput_rounds=tps, p50_ratio_vs_reference=p50_r[0],
                               throughput_ratio_vs_reference=tp_r[0], p50_ratio_interval=[p50_r[1], p50_r[2]],
                               throughput_ratio_interval=[tp_r[1], tp_r[2]], ratio_coverage=round(tp_r[3], 3),
                               flagged_rounds=sum(bool(m.interference and m.interference.flagged) for m in ms), method=method)
    return out
