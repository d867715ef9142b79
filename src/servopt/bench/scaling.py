"""How a variant scales with this machine's cores, in the layout ``servopt serve`` runs: the points a projection to
the target's instance is fitted to (``optimize.scaling``).

For each core count N up to this machine's, two figures per round:
- throughput: N single-thread instances (sessions opened as the server opens them) each calling the model on full
  batches at once from its own thread, as the server's instances do — samples/s of all of them together;
- one request: a session with N threads answering one sample at a time — its p50 (what a lone request gets from the
  server's solo session).
Rounds alternate the variants' order and the core counts' order, so a drift of the shared machine does not favour
one. The job runs in its own process (``launcher.launch``) like every measurement.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from servopt.bench.interference import DEFAULT_THRESHOLD, CpuMonitor
from servopt.bench.jobs import JobBase, OpenSpec, _environment, register_job
from servopt.contracts import Contract, Scaling, ScalingCurve, ScalingPoint


def open_as_served(spec: OpenSpec, threads: int):
    """A session of ``spec`` with ``threads`` intra-op threads and the options the server adds (``serving_options``)."""
    from servopt.runtimes.base import get_runtime, open_session

    rt = get_runtime(spec.runtime)
    options = rt.serving_options(rt.with_threads(rt.parse_options(spec.options), threads))
    return open_session(spec.artifact, spec.runtime, options)


def instances_throughput(sessions: list, feed: dict[str, np.ndarray], batch: int, seconds: float) -> float:
    """Samples/s of ``sessions`` each calling on ``feed`` from its own thread for ``seconds``, started together."""
    counts = [0] * len(sessions)
    gate = threading.Barrier(len(sessions) + 1)
    stop = [0.0]

    def work(i: int) -> None:
        prepared = sessions[i].prepare(feed)
        gate.wait()
        while time.perf_counter() < stop[0]:
            sessions[i].run_prepared(prepared)
            counts[i] += 1

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(sessions))]
    for w in workers:
        w.start()
    start = time.perf_counter()
    stop[0] = start + seconds
    gate.wait()
    for w in workers:
        w.join()
    return sum(counts) * batch / (time.perf_counter() - start)


def single_p50(session, feeds: list[dict[str, np.ndarray]], seconds: float, min_runs: int = 20) -> float:
    """Median ms of one-sample calls, round-robin over ``feeds``, for ``seconds`` and ``min_runs`` at least."""
    prepared = [session.prepare(f) for f in feeds]
    times: list[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end or len(times) < min_runs:
        t = time.perf_counter()
        session.run_prepared(prepared[i % len(prepared)])
        times.append((time.perf_counter() - t) * 1000)
        i += 1
    return float(np.median(times))


def noisy_rounds(curve: ScalingCurve) -> tuple[int, int, float]:
    """(rounds in which other processes used more than ``interference.DEFAULT_THRESHOLD`` of the machine, rounds, the
    largest share they used): a fit to a curve taken while others ran reads their load as the model's scaling."""
    shares = [x for p in curve.points for x in p.other_share]
    return sum(x > DEFAULT_THRESHOLD for x in shares), len(shares), max(shares, default=0.0)


def machine_cores() -> int:
    """Cores this process may run on (an affinity mask or a container's cpuset counts, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def core_counts(limit: int) -> list[int]:
    """The core counts measured up to ``limit``: every one up to 4, then powers of two, and ``limit`` itself (a
    64-core node of the target's kind measures 1, 2, 3, 4, 8, 16, 32, 64, not 64 points)."""
    return sorted({n for n in (1, 2, 3, 4) if n <= limit} | {2 ** k for k in range(2, 12) if 2 ** k <= limit} | {max(1, limit)})


@register_job
class ScalingJob(JobBase):
    """Each variant at 1 … ``max_cores`` cores (throughput of single-thread instances, one request's p50)."""

    kind: Literal["scaling"] = "scaling"
    result_type: ClassVar[type[Contract]] = Scaling
    timeout_s: ClassVar[float] = 900.0
    sessions: list[OpenSpec]
    data: str
    batch_size: int = 32
    max_cores: int | None = None  # at most this many (the target's instance's vCPUs); None: every core this process may use
    rounds: int = 3
    seconds: float = 0.6  # per figure, per point, per round
    isa_cap: str | None = None  # recorded: the caps themselves are in ``env``
    warmup: int = Field(3, ge=1)

    def run(self, started: float) -> Scaling:
        from servopt.data.dataset import Dataset
        from servopt.errors import UserError

        data = Dataset.load(Path(self.data))
        cores = core_counts(min(self.max_cores or machine_cores(), machine_cores()))
        batch = data.batch(self.batch_size)
        singles = [data.slice(i, i + 1) for i in range(min(len(data), 16))]
        opened: dict[str, tuple[list, dict[int, object]]] = {}
        curves: dict[str, ScalingCurve] = {}
        for spec in self.sessions:
            try:
                instances = [open_as_served(spec, 1) for _ in cores]
                threaded = {n: instances[0] if n == 1 else open_as_served(spec, n) for n in cores}
                for s in [*instances, *threaded.values()]:
                    for _ in range(self.warmup):
                        s.run(singles[0])
                    s.run(batch)
            except UserError as e:
                curves[spec.name] = ScalingCurve(variant=spec.name, batch_size=self.batch_size, error=e.problem)
                continue
            opened[spec.name] = (instances, threaded)
        figures: dict[str, dict[int, tuple[list[float], list[float], list[float]]]] = {
            n: {c: ([], [], []) for c in cores} for n in opened}
        names = list(opened)
        for r in range(self.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                instances, threaded = opened[name]
                for n in cores if r % 2 == 0 else cores[::-1]:
                    tp, p50, others = figures[name][n]
                    with CpuMonitor() as monitor:
                        tp.append(instances_throughput(instances[:n], batch, self.batch_size, self.seconds))
                        p50.append(single_p50(threaded[n], singles, self.seconds))
                    others.append(monitor.report.other_share if monitor.report else 0.0)
        for name in names:
            curves[name] = ScalingCurve(variant=name, batch_size=self.batch_size, points=[
                ScalingPoint(cores=n, instances=n, threads_per_instance=1, throughput_ips=figures[name][n][0],
                             p50_ms=figures[name][n][1], other_share=figures[name][n][2]) for n in cores])
        return Scaling(curves=curves, rounds=self.rounds, environment=_environment(None), isa_cap=self.isa_cap)

    def runtimes(self) -> list[str]:
        return [s.runtime for s in self.sessions]
