"""Same-run comparison of variants that cannot share one process: each measured in a fresh process, taking turns.

A runtime living in a Python environment of its own (ONNX Runtime's OpenVINO execution provider, onnxruntime-gpu)
cannot join the interleaved re-measure, which runs every candidate in one process. Here each variant and the
reference are measured in turns, each time in a fresh process (its runtime's environment), the order flipped every round
(``bench.rounds``: ref A B, B A ref, …), and every ratio is the median of per-round ratios to the reference of the same
round (``bench.rounds.side_by_side``): what the interleaved re-measure gives, at process granularity. ``benchmarks/alternating.py`` uses it for its comparisons; the sweep for its candidates in an
environment of their own, so such a variant can win a CPU target.
"""

from __future__ import annotations

from pathlib import Path

from servopt.bench.jobs import MeasureJob
from servopt.bench.launcher import launch
from servopt.bench.rounds import take_turns
from servopt.contracts import Measured


class AlternationFailed(Exception):
    """A variant's process failed in some round: the reason, and where its log is."""


def alternate(jobs: dict[str, MeasureJob], rounds: int, workdir: Path, deadline: float | None = None) -> dict[str, list[Measured]]:
    """Every job once per round, the order flipped each round (``bench.rounds.take_turns``), each in a fresh process; a
    failure raises ``AlternationFailed``, a job still running at ``deadline`` (a time budget's end) ``launcher.OutOfTime``.
    Each list is in round order, whatever order the round ran in."""

    def measure(name: str, i: int) -> Measured:
        m = launch(jobs[name], workdir / name / f"round-{i}", None, deadline).result
        if m is None or m.status != "ok" or m.latency_ms is None or m.throughput_ips is None or not m.throughput_ips.batch:
            why = m.error if m is not None and m.error else "no figures"
            raise AlternationFailed(f"{name}, round {i}: {why} (see {workdir / name / f'round-{i}' / 'job.log'})")
        return m

    measured = take_turns(list(jobs), rounds, measure).measured
    return {name: [m for m in ms if m is not None] for name, ms in measured.items()}
