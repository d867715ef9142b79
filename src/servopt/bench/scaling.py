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

from servopt.bench.cputime import busy_threads, thread_cores, threads_cpu_s
from servopt.bench.interference import DEFAULT_THRESHOLD, CpuMonitor
from servopt.bench.jobs import JobBase, OpenSpec, _environment, register_job
from servopt.contracts import Contract, Environment, Scaling, ScalingCurve, ScalingPoint
from servopt.machine import usable_cores


def open_as_served(spec: OpenSpec, threads: int):
    """A session of ``spec`` with ``threads`` intra-op threads and the options the server adds (``serving_options``)."""
    from servopt.runtimes.base import get_runtime, open_session

    rt = get_runtime(spec.runtime)
    options = rt.serving_options(rt.with_threads(rt.parse_options(spec.options), threads))
    return open_session(spec.artifact, spec.runtime, options)


class InstancesRun(Contract):
    """What N sessions called together, each from a thread of its own in one process, did: their samples/s, and the
    CPU behind it over the middle of the run (the window). What the threading contract tests assert on, where a
    throughput figure on a shared machine could not be (``tests/test_threads.py``, issue 41)."""

    instances: int
    samples_per_s: float
    window_s: float
    caller_cpu_s: list[float]  # each instance's calling thread
    threads_cpu_s: list[float]  # every thread of this process that burned CPU (a runtime's helpers too), busiest first
    caller_cores: list[list[int] | None]  # each calling thread's narrowest affinity mask seen while it ran (pinned: one)
    other_share: float = 0.0  # of the machine, used by other processes meanwhile (``interference.CpuMonitor``)

    @property
    def cores_busy(self) -> float:
        """Cores' worth of CPU the process burned in the window."""
        return sum(self.threads_cpu_s) / self.window_s if self.window_s > 0 else 0.0

    def busy_threads(self, share: float = 0.25) -> int:
        """Threads that burned at least ``share`` of the busiest one's CPU: relative, so a machine other processes
        crowd (each thread then gets less of a core) counts the same threads as a quiet one."""
        top = max(self.threads_cpu_s, default=0.0)
        return sum(c >= share * top for c in self.threads_cpu_s) if top > 0 else 0

    def shared_core(self) -> bool:
        """Whether two instances' threads were confined to one and the same core."""
        single = [tuple(c) for c in self.caller_cores if c is not None and len(c) == 1]
        return len(single) != len(set(single))


def run_instances(sessions: list, feed: dict[str, np.ndarray], batch: int, seconds: float, samples: int = 5) -> InstancesRun:
    """``sessions`` each calling on ``feed`` from its own thread for ``seconds``, started together; their threads' CPU
    read from /proc over the middle 70 % of the run, and their affinity masks ``samples`` times within it."""
    counts = [0] * len(sessions)
    tids = [0] * len(sessions)
    gate = threading.Barrier(len(sessions) + 1)
    # The workers run until told, after the last reading: a main thread late to wake on a crowded machine still reads
    # them running, and a slow start does not eat into the run.
    stop = [float("inf")]

    def work(i: int) -> None:
        tids[i] = threading.get_native_id()
        prepared = sessions[i].prepare(feed)
        gate.wait()
        while time.perf_counter() < stop[0]:
            sessions[i].run_prepared(prepared)
            counts[i] += 1

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(sessions))]
    for w in workers:
        w.start()
    with CpuMonitor() as monitor:
        gate.wait()
        start = time.perf_counter()
        pid = os.getpid()

        def until(fraction: float) -> None:
            time.sleep(max(0.0, start + fraction * seconds - time.perf_counter()))

        until(0.15)
        before, t0 = threads_cpu_s(pid), time.perf_counter()
        masks: list[list[frozenset[int]]] = [[] for _ in sessions]
        for k in range(samples):
            until(0.15 + 0.7 * (k + 1) / (samples + 1))
            for i, tid in enumerate(tids):
                if (cores := thread_cores(tid)) is not None:
                    masks[i].append(cores)
        until(0.85)
        after, window = threads_cpu_s(pid), time.perf_counter() - t0
        until(1.0)
        stop[0] = 0.0
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - start
    busy = busy_threads(before, after, window, share=0.0)
    return InstancesRun(
        instances=len(sessions), samples_per_s=sum(counts) * batch / elapsed, window_s=window,
        caller_cpu_s=[after.get(t, 0.0) - before.get(t, 0.0) for t in tids], threads_cpu_s=sorted(busy.values(), reverse=True),
        caller_cores=[sorted(frozenset.intersection(*m)) if m else None for m in masks],
        other_share=monitor.report.other_share if monitor.report else 0.0)


def instances_throughput(sessions: list, feed: dict[str, np.ndarray], batch: int, seconds: float) -> float:
    """Samples/s of ``sessions`` each calling on ``feed`` from its own thread for ``seconds``, started together."""
    return run_instances(sessions, feed, batch, seconds, samples=1).samples_per_s


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
    return usable_cores()


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


class InstancesProbe(Contract):
    """The result of an ``InstancesJob``: what each instance count did, and what the runtime says it set."""

    variant: str
    threads: list[int | str]  # each one-thread instance's threads, read back
    pinned: list[bool | None]  # each instance's pinning where the runtime has one (OpenVINO reads it back, its EP says what it asked)
    runs: list[InstancesRun]
    environment: Environment | None = None


@register_job
class InstancesJob(JobBase):
    """One variant in the layout the scaling job and ``servopt serve`` run: two one-thread instances and a session
    with every core opened after them, in one process; then 1 and 2 (``counts``, in that order) instances run together
    (``run_instances``). In a fresh process, in the runtime's own environment where it has one."""

    kind: Literal["instances"] = "instances"
    result_type: ClassVar[type[Contract]] = InstancesProbe
    timeout_s: ClassVar[float] = 600.0
    session: OpenSpec
    data: str
    batch_size: int = 32
    seconds: float = 2.0
    counts: list[int] = Field(default_factory=lambda: [1, 2])
    warmup: int = Field(2, ge=1)

    def run(self, started: float) -> InstancesProbe:
        from servopt.data.dataset import Dataset

        feed = Dataset.load(Path(self.data)).batch(self.batch_size)
        instances = [open_as_served(self.session, 1) for _ in range(max(self.counts))]
        wide = open_as_served(self.session, usable_cores())
        for s in [*instances, wide]:
            for _ in range(self.warmup):
                s.run(feed)
        infos = [s.info() for s in instances]
        runs = [run_instances(instances[:n], feed, self.batch_size, self.seconds) for n in self.counts]
        return InstancesProbe(variant=self.session.name, threads=[i.threads for i in infos],
                              pinned=[i.details.get("cpu_pinning", i.details.get("cpu_pinning_asked")) for i in infos], runs=runs,
                              environment=_environment(instances[0]))

    def runtimes(self) -> list[str]:
        return [self.session.runtime]
