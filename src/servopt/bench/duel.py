"""Settling a close call: variants taking turns block by block in one process.

The interleaved re-measure (``jobs.run_interleave``) times each variant for 1.5 s per figure per round, so the two
figures of a round are seconds apart, and on a shared 2-core machine a round moves a variant's p50 by up to 30 % (the
text demo's fused INT8 encoder: 2.26, 1.58, 2.43 ms in three rounds). Taking turns every few tens of milliseconds
cancels that drift pair by pair: of the two encoders that three rounds put 4.6 % apart on p50 (a tie), the fused one
took 0.78–0.85× the other's p50 time in each of six duels, every interval below 1 (AMD EPYC, AVX2; docs/benchmarks.md).

Per figure, every variant runs a block of calls on the same inputs in turn (order reversed each cycle, so neither
always goes first); a block's figure is its median call time (single-sample p50) or its mean call time (a batch's
throughput); each cycle gives every pair one ratio. The median ratio's distribution-free interval decides, looked at
every few cycles, stopping when every pair is decided or the time is up (sequential: the interval is far wider than
95 % for the repeated looks). No library does paired, sequential block alternation of in-process sessions, so it is here.
"""

from __future__ import annotations

import math
import statistics
import time
from itertools import combinations
from typing import TYPE_CHECKING, Literal

from servopt.contracts import Duel, Phase
from servopt.machine import node_name

if TYPE_CHECKING:
    from servopt.data.dataset import Dataset

Verdict = Literal["a", "b", "tie", "undecided"]
BLOCK_SECONDS = {"p50_ms": 0.04, "throughput_ips": 0.3}  # long enough for a median, short against the drift
LOOK_EVERY = 5  # cycles between two looks at the intervals


def median_interval(sorted_logs: list[float], z: float) -> tuple[float, float]:
    """The median's interval from binomial order statistics at ``z`` (distribution-free: one slow block, an
    interruption on the shared machine, moves it by one rank, not by its size)."""
    n = len(sorted_logs)
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return sorted_logs[lo], sorted_logs[hi]


def verdict(log_ratios: list[float], tie_gap: float, z: float, min_pairs: int) -> tuple[Verdict, float, float, float]:
    """(verdict, median, low, high) of the per-pair log(a's time / b's time). ``a`` (or ``b``) when the interval lies
    on its side of 1 and the median lead is ``tie_gap`` or more; ``tie`` when the interval shows a lead smaller than
    that, or lies within ``tie_gap`` either way; else ``undecided`` (more pairs could tell)."""
    s = sorted(log_ratios)  # at least one pair: a duel runs one cycle before it looks
    m = statistics.median(s)
    lo, hi = median_interval(s, z)
    if len(s) < min_pairs:
        return "undecided", m, lo, hi
    band = math.log1p(tie_gap)
    if hi < 0:
        return ("a" if -m >= band else "tie"), m, lo, hi
    if lo > 0:
        return ("b" if m >= band else "tie"), m, lo, hi
    if -band < lo and hi < band:
        return "tie", m, lo, hi
    return "undecided", m, lo, hi


def settled(logs: list[list[float]], tie_gap: float, z: float, min_pairs: int) -> bool:
    """The stopping rule: at a look (every ``LOOK_EVERY`` cycles from ``min_pairs`` on), every pair decided."""
    n = len(logs[0]) if logs else 0
    return (n >= min_pairs and n % LOOK_EVERY == 0
            and all(verdict(v, tie_gap, z, min_pairs)[0] != "undecided" for v in logs))


def _block(session, prepared: list, first: int, calls: int, what: str) -> float:
    """One block: ``calls`` calls on the inputs from ``first`` on; its median call time (p50) or mean (throughput)."""
    times = []
    for i in range(calls):
        x = prepared[(first + i) % len(prepared)]
        t0 = time.perf_counter_ns()
        session.run_prepared(x)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) if what == "p50_ms" else sum(times) / len(times)


def take_turns(sessions: dict, data: Dataset, batch_size: int, figures: list[str], seconds: float, tie_gap: float, z: float,
               min_pairs: int) -> tuple[list[Duel], list[Phase]]:
    """Every pair of ``sessions`` (opened and warm, name → session) on every figure, at most ``seconds`` each."""
    names = list(sessions)
    duels: list[Duel] = []
    phases: list[Phase] = []
    for what in figures:
        if what == "p50_ms":
            prepared = {n: [s.prepare(data.slice(i, i + 1)) for i in range(min(len(data), 32))] for n, s in sessions.items()}
        else:
            prepared = {n: [s.prepare(data.batch(batch_size, offset=o * batch_size)) for o in range(2)] for n, s in sessions.items()}
        # warm each on this figure's inputs (the first calls on new shapes are slow), then size the block from the
        # slowest's call (a cycle: about BLOCK_SECONDS per variant, however far apart they are)
        for n, s in sessions.items():
            _block(s, prepared[n], 0, 3, what)
        per_call = max(_block(s, prepared[n], 0, 5, "p50_ms") for n, s in sessions.items())
        calls = max(3 if what == "p50_ms" else 1, round(BLOCK_SECONDS[what] / max(per_call / 1e9, 1e-6)))
        logs: dict[tuple[str, str], list[float]] = {pair: [] for pair in combinations(names, 2)}
        start, wall = time.perf_counter(), time.time()
        cycle = 0
        while True:
            order = names if cycle % 2 == 0 else names[::-1]
            block = {n: _block(sessions[n], prepared[n], cycle * calls, calls, what) for n in order}
            for a, b in logs:
                logs[a, b].append(math.log(block[a] / block[b]))
            cycle += 1
            if time.perf_counter() - start >= seconds or settled(list(logs.values()), tie_gap, z, min_pairs):
                break
        phases.append(Phase(name=f"duel:{what}", start=wall, stop=time.time(), node=node_name()))
        for (a, b), v in logs.items():
            said, m, lo, hi = verdict(v, tie_gap, z, min_pairs)
            duels.append(Duel(a=a, b=b, what=what, pairs=len(v), time_ratio=math.exp(m),
                              time_ratio_interval=[math.exp(lo), math.exp(hi)], verdict=said))
    return duels, phases
