"""Timing loops and their statistics.

The stopping rule follows MLPerf LoadGen: a figure is valid only when the loop
ran BOTH at least ``min_runs`` times and for at least ``min_seconds``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class LoopResult:
    times_ns: list[int]
    wall_s: float
    stopped_by: str  # "rule" (both minimums met) or "max_seconds"


def timed_loop(
    call: Callable[[Any], Any],
    inputs: Sequence[Any],
    *,
    min_runs: int,
    min_seconds: float,
    max_seconds: float = 120.0,
    warmup: int = 10,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> LoopResult:
    """Call ``call`` on ``inputs`` round-robin until both minimums are met (or ``max_seconds``)."""
    k = len(inputs)
    for i in range(warmup):
        call(inputs[i % k])
    times: list[int] = []
    append = times.append
    start = clock()
    min_end = start + int(min_seconds * 1e9)
    max_end = start + int(max_seconds * 1e9)
    i = 0
    while True:
        t0 = clock()
        call(inputs[i % k])
        t1 = clock()
        append(t1 - t0)
        i += 1
        if i >= min_runs and t1 >= min_end:
            stopped = "rule"
            break
        if t1 >= max_end:
            stopped = "max_seconds"
            break
    return LoopResult(times, (clock() - start) / 1e9, stopped)


Z95 = 1.959964


def median_ranks(n: int, z: float = Z95) -> tuple[int, int]:
    """The 0-based ranks, of ``n`` sorted draws, that bound the median's binomial order-statistics interval at ``z``
    (with few draws, the widest: the range). The one rule for a median's interval: of a phase's calls, of a duel's
    pairs, of rounds' ratios."""
    half = z * math.sqrt(n) / 2
    return max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)


def median_interval(sorted_values, z: float = Z95) -> tuple[float, float]:
    """The median's distribution-free interval (binomial order statistics at ``z``): one slow call, block or round on
    the shared machine moves it by one rank, not by its size."""
    lo, hi = median_ranks(len(sorted_values), z)
    return float(sorted_values[lo]), float(sorted_values[hi])


def median_ci95(sorted_values: np.ndarray) -> tuple[float, float]:
    """Distribution-free 95 % confidence interval of the median (``median_interval`` at 95 %)."""
    return median_interval(sorted_values, Z95)


def latency_summary(times_ns: Sequence[int]) -> dict:
    ms = np.sort(np.asarray(times_ns, dtype=np.float64) / 1e6)
    lo, hi = median_ci95(ms)
    return {
        "p50": float(np.percentile(ms, 50)),
        "p90": float(np.percentile(ms, 90)),
        "p95": float(np.percentile(ms, 95)),
        "p99": float(np.percentile(ms, 99)),
        "mean": float(ms.mean()),
        "stdev": float(ms.std(ddof=1)) if len(ms) > 1 else 0.0,
        "min": float(ms[0]),
        "max": float(ms[-1]),
        "n": len(ms),
        "p50_ci95": [lo, hi],
    }


def throughput(times_ns: Sequence[int], samples_per_call: int) -> float:
    """Samples per second over all timed calls (total work / total time)."""
    total_s = sum(times_ns) / 1e9
    return samples_per_call * len(times_ns) / total_s if total_s > 0 else 0.0
