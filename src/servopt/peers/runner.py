"""The runner: servopt's pick and the peers' answers measured in turn, each in a fresh process, the order flipped
every round, and each figure reported as the median of same-round ratios with the median's distribution-free interval.

A process per measurement (``bench.alternate``'s way, for answers that cannot share a process: another environment,
another library's threads) keeps one tool's allocator, thread pool and caches from the next one's figures. Flipping
the order (pick first, then last, …) keeps whichever drift the shared machine has from always favouring the one that
runs first. A round in which some measuring process saw other processes use the CPU (its ``interference``) is flagged:
kept, since the ratio pairs it with its own round's pick, but shown.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from servopt.bench.duel import median_interval
from servopt.bench.jobs import MeasureJob
from servopt.contracts import Measured, PeerRatio
from servopt.peers.scenario import Scenario

Measure = Callable[[MeasureJob, Path], Measured]
Z95 = 1.959964


def round_order(names: list[str], i: int) -> list[str]:
    """Round ``i``'s order: as given on even rounds, reversed on odd ones."""
    return list(names) if i % 2 == 0 else list(reversed(names))


def launch_measure(job: MeasureJob, workdir: Path) -> Measured:
    """One measurement in a fresh process; a failed process comes back as a failed ``Measured`` with the reason."""
    from servopt.bench.launcher import launch

    launched = launch(job, workdir)
    return launched.result if launched.result is not None else Measured(status="failed", error=launched.error)


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


def run_rounds(jobs: dict[str, MeasureJob], rounds: int, workdir: Path, measure: Measure = launch_measure,
               progress: Callable[[str], None] = lambda _m: None) -> Rounds:
    """Every job once per round, in ``round_order``; a job that fails is dropped from later rounds (its reason kept).
    The first job is the reference (the pick): when it fails, no round counts, and the runner stops."""
    names = list(jobs)
    out = Rounds(measured={n: [] for n in names}, order=[])
    for i in range(rounds):
        order = [n for n in round_order(names, i) if n not in out.failed]
        out.order.append(order)
        for name in names:
            if name in out.failed:
                out.measured[name].append(None)
        for name in order:
            progress(f"round {i + 1}/{rounds}: measuring {name}")
            m = measure(jobs[name], workdir / name / f"round-{i}")
            if m.status != "ok":
                out.failed[name] = m.error or "the measurement failed"
                out.measured[name].append(None)
                continue
            out.measured[name].append(m)
        if names[0] in out.failed:
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
    n = len(s)
    half = z * math.sqrt(n) / 2
    lo_i, hi_i = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
    lo, hi = median_interval(s, z)
    return statistics.median(s), lo, hi, coverage(n, lo_i, hi_i)


def ratios(rounds: Rounds, pick: str, peer: str, scenarios: list[Scenario]) -> list[PeerRatio]:
    """Per scenario, ``peer``'s figure ÷ the pick's in the same round, over the rounds both have a figure."""
    out = []
    for sc in scenarios:
        pairs = [(sc.figure(a), sc.figure(b)) for a, b in zip(rounds.measured[peer], rounds.measured[pick], strict=False)
                 if a is not None and b is not None]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None and b > 0]
        if not pairs:
            continue
        per_round = [a / b for a, b in pairs]
        median, lo, hi, conf = ratio_interval(per_round)
        out.append(PeerRatio(metric=sc.metric, scenario=sc.name, better=sc.better, ratio=median, low=lo, high=hi,
                             confidence=conf, rounds=per_round, pick_median=statistics.median(b for _, b in pairs),
                             peer_median=statistics.median(a for a, _ in pairs)))
    return out
