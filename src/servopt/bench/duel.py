"""Settling a close call: variants taking turns block by block in one process.

The interleaved re-measure (``jobs.run_interleave``) times each variant for 1.5 s per figure per round, so the two
figures of a round are seconds apart, and on a shared 2-core machine a round moves a variant's p50 by up to 30 % (the
text demo's fused INT8 encoder: 2.26, 1.58, 2.43 ms in three rounds). Taking turns every few tenths of a second
cancels that drift pair by pair: of the two encoders that three rounds put 4.6 % apart on p50 (a tie), the fused one
took 0.78–0.85× the other's p50 time in each of six duels of 40 ms blocks, every interval below 1 (AMD EPYC, AVX2;
docs/benchmarks.md).

Per figure, every variant runs a block of calls on the same inputs in turn (order reversed each cycle, so neither
always goes first); a block's figure is its median call time (single-sample p50) or its mean call time (a batch's
throughput); each cycle gives every pair one ratio. The median ratio's distribution-free interval decides, looked at
every few cycles, stopping when every pair is decided or the time is up (sequential: the interval is far wider than
95 % for the repeated looks). No library does paired, sequential block alternation of in-process sessions, so it is here.

A block measures what serving has: one model computing, warm, its threads waiting as a server sets them. Sessions are
opened with their runtime's serving options (``optimize.sweep.as_served``: ONNX Runtime's idle threads do not spin), and the
first calls after each switch are run but not counted. Blocks of 40 ms with spinning sessions measured something
else: an ONNX Runtime worker spins for 2^20 pauses (tens of milliseconds) after its session's last call
(``WorkerLoop``), so most of the next model's block ran with one of the two cores taken, and it began with the other's
weights in the caches. On a 2-core AMD
EPYC Zen 2 such a duel put the image demo's INT8 pick 9 % ahead of fp32 on p50 (interval 4.8-14.8 %) where the two in
separate processes, alternating, measured 0.986x (FIELD-NOTES.md).
"""

from __future__ import annotations

import math
import statistics
import time
from itertools import combinations
from typing import TYPE_CHECKING, Literal

from servopt.bench.stats import median_interval
from servopt.contracts import Duel, Phase
from servopt.machine import node_name

if TYPE_CHECKING:
    from servopt.data.dataset import Dataset

Verdict = Literal["a", "b", "tie", "undecided"]
# A block's counted calls: long enough for a median of warm calls, short against the drift (the interleaved rounds'
# figures are 1.5 s apart).
BLOCK_SECONDS = {"p50_ms": 0.1, "throughput_ips": 0.3}
# Run after each switch and not counted: the model's weights back in the caches, the other session's threads asleep.
# At least WARM_CALLS, or WARM_SECONDS of calls where those are shorter.
WARM_SECONDS = {"p50_ms": 0.03, "throughput_ips": 0.0}
WARM_CALLS = {"p50_ms": 3, "throughput_ips": 1}
LOOK_EVERY = 5  # cycles between two looks at the intervals


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


def _block(session, prepared: list, first: int, calls: int, what: str, warm: int = 0) -> float:
    """One block: ``warm`` calls not counted (the first after a switch), then ``calls`` calls on the inputs from
    ``first`` on; its median call time (p50) or mean (throughput) over those."""
    for i in range(warm):
        session.run_prepared(prepared[(first + i) % len(prepared)])
    first += warm
    times = []
    for i in range(calls):
        x = prepared[(first + i) % len(prepared)]
        t0 = time.perf_counter_ns()
        session.run_prepared(x)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) if what == "p50_ms" else sum(times) / len(times)


def block_calls(what: str, per_call_ns: float, block_seconds: dict[str, float] | None = None,
                warm_seconds: dict[str, float] | None = None) -> tuple[int, int]:
    """(calls counted, calls run first and not counted) of a block on ``what`` whose slowest call takes ``per_call_ns``."""
    per_call = max(per_call_ns / 1e9, 1e-6)
    calls = max(3 if what == "p50_ms" else 1, round((block_seconds or BLOCK_SECONDS)[what] / per_call))
    if warm_seconds is not None and warm_seconds[what] <= 0:
        return calls, 0
    return calls, max(WARM_CALLS[what], round((warm_seconds or WARM_SECONDS)[what] / per_call))


def take_turns(sessions: dict, data: Dataset, batch_size: int, figures: list[str], seconds: float, tie_gap: float, z: float,
               min_pairs: int, block_seconds: dict[str, float] | None = None, warm_seconds: dict[str, float] | None = None
               ) -> tuple[list[Duel], list[Phase]]:
    """Every pair of ``sessions`` (opened and warm, name → session) on every figure, at most ``seconds`` each.
    ``block_seconds`` and ``warm_seconds`` (a figure → seconds; 0 warm: none) replace the defaults, for experiments."""
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
        calls, warm = block_calls(what, per_call, block_seconds, warm_seconds)
        logs: dict[tuple[str, str], list[float]] = {pair: [] for pair in combinations(names, 2)}
        start, wall = time.perf_counter(), time.time()
        cycle = 0
        while True:
            order = names if cycle % 2 == 0 else names[::-1]
            block = {n: _block(sessions[n], prepared[n], cycle * (calls + warm), calls, what, warm) for n in order}
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

