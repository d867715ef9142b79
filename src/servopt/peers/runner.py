"""The runner: servopt's pick and the peers' answers measured in turn, each in a fresh process, the order flipped
every round, and each figure reported as the median of same-round ratios with the median's distribution-free interval.

A process per measurement (``bench.alternate``'s way, for answers that cannot share a process: another environment,
another library's threads) keeps one tool's allocator, thread pool and caches from the next one's figures. Flipping
the order (pick first, then last, …: ``bench.rounds``, the library's one round loop) keeps whichever drift the shared machine has from always favouring the one that
runs first. A round in which some measuring process saw other processes use the CPU (its ``interference``) is flagged:
kept, since the ratio pairs it with its own round's pick, but shown.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from servopt.bench.jobs import MeasureJob
from servopt.bench.rounds import Rounds, coverage, ratio_interval, round_order, take_turns
from servopt.contracts import Measured
from servopt.peers.contracts import PeerRatio
from servopt.peers.scenario import Scenario

__all__ = ["Measure", "Rounds", "coverage", "launch_measure", "ratio_interval", "ratios", "round_order", "run_rounds"]

Measure = Callable[[MeasureJob, Path], Measured]


def launch_measure(job: MeasureJob, workdir: Path) -> Measured:
    """One measurement in a fresh process; a failed process comes back as a failed ``Measured`` with the reason."""
    from servopt.bench.launcher import launch

    launched = launch(job, workdir)
    return launched.result if launched.result is not None else Measured(status="failed", error=launched.error)


def run_rounds(jobs: dict[str, MeasureJob], rounds: int, workdir: Path, measure: Measure = launch_measure,
               progress: Callable[[str], None] = lambda _m: None) -> Rounds:
    """Every job once per round, in ``round_order`` (``bench.rounds.take_turns``, the library's one round loop); a job
    that fails is dropped from later rounds (its reason kept). The first job is the reference (the pick): when it
    fails, no round counts, and the runner stops."""
    return take_turns(list(jobs), rounds, lambda name, i: measure(jobs[name], workdir / name / f"round-{i}"), progress)


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
        out.append(PeerRatio(metric=sc.metric, scenario=sc.name, label=sc.label or sc.metric, better=sc.better, ratio=median, low=lo, high=hi,
                             confidence=conf, rounds=per_round, pick_median=statistics.median(b for _, b in pairs),
                             peer_median=statistics.median(a for a, _ in pairs)))
    return out
