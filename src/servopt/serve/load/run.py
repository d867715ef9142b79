"""The one request loop: a schedule (closed loop, or open with Poisson or constant arrivals) drives a sender, and every
request lands in a tally. Everything in servopt that sends load (``servopt loadtest``, the capacity search, the
overload check, the served comparisons, the benchmarks) runs it; ``tests/test_layers.py`` checks no other module
opens a request loop of its own.

- **Closed** (``Closed(concurrency)``): that many clients, each sending its next request when its answer is in
  (LoadGen's single-stream, times ``concurrency``): the server's throughput at a fixed concurrency.
- **Open** (``Open(rate)``): arrivals at ``rate``/s whatever the answers do (MLPerf's server scenario); each request's
  latency runs from its scheduled time, and one arrival past ``max_in_flight`` outstanding requests is counted as not
  sent, never queued in the client.

A run is an untimed warm-up, then ``seconds`` timed; ``stop()`` (the sweep stopping on SIGTERM) ends it at the next
arrival, the requests in flight abandoned.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from servopt.serve.load.requests import Pool
from servopt.serve.load.senders.base import Answer, Kind, Sender
from servopt.serve.load.tally import DEFAULT_MARGIN_MS, StepSummary, Tally


@dataclass(frozen=True)
class Closed:
    """``concurrency`` clients, each sending its next request when its answer is in."""

    concurrency: int

    @property
    def mode(self) -> str:
        return "closed"

    @property
    def level(self) -> float:
        return self.concurrency


@dataclass(frozen=True)
class Open:
    """Arrivals at ``rate``/s (Poisson, or evenly spaced) whatever the answers do, from a seeded schedule."""

    rate: float
    arrivals: Literal["poisson", "constant"] = "poisson"
    seed: int = 0

    @property
    def mode(self) -> str:
        return f"open-{self.arrivals}"

    @property
    def level(self) -> float:
        return self.rate

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"an open loop's rate must be positive, not {self.rate}")

    def times(self, start: float, seconds: float, seed: int | None = None) -> Iterator[float]:
        """The scheduled send times from ``start`` for ``seconds`` (``perf_counter`` clock)."""
        rng = random.Random(self.seed if seed is None else seed)
        t = start
        while True:
            t += rng.expovariate(self.rate) if self.arrivals == "poisson" else 1.0 / self.rate
            if t >= start + seconds:
                return
            yield t


Schedule = Closed | Open


def never() -> bool:
    return False


async def _closed(sender: Sender, pool: Pool, schedule: Closed, seconds: float, tally: Tally, max_requests: int | None,
                  stop: Callable[[], bool], pause_s: float) -> None:
    end = tally.started + seconds
    budget = [max_requests if max_requests is not None else 1 << 62]

    async def client() -> None:
        while budget[0] > 0 and not stop():
            now = time.perf_counter()
            if now >= end:
                return
            budget[0] -= 1
            answer = await sender.send(pool.next())
            tally.add(now, now, time.perf_counter(), answer)  # a closed loop sends when it is ready: its schedule
            if pause_s and answer.kind is not Kind.ACCEPTED:
                await asyncio.sleep(pause_s)

    await asyncio.gather(*(client() for _ in range(schedule.concurrency)))


async def _open(sender: Sender, pool: Pool, schedule: Open, seconds: float, tally: Tally, max_in_flight: int,
                seed: int | None, stop: Callable[[], bool], drain_s: float) -> None:
    in_flight: dict[asyncio.Task, float] = {}  # each request under way → its scheduled time

    async def one(scheduled: float) -> None:
        sent = time.perf_counter()
        answer = await sender.send(pool.next())
        tally.add(scheduled, sent, time.perf_counter(), answer)

    for t in schedule.times(tally.started, seconds, seed):
        if stop():
            break
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(in_flight) >= max_in_flight:
            tally.unsent += 1
            continue
        task = asyncio.create_task(one(t))
        in_flight[task] = t
        task.add_done_callback(lambda done: in_flight.pop(done, None))
    if in_flight and not stop():
        await asyncio.wait(set(in_flight), timeout=drain_s)
    for task, scheduled in list(in_flight.items()):  # no answer in time (or stopping): an error each, never left out
        task.cancel()
        now = time.perf_counter()
        tally.add(scheduled, scheduled, now, Answer(Kind.ERROR, "no answer"))


async def run(sender: Sender, pool: Pool, schedule: Schedule, seconds: float, *, warmup: float = 0.0,
              max_in_flight: int = 4096, max_requests: int | None = None, seed: int | None = None,
              margin_ms: float = DEFAULT_MARGIN_MS, stop: Callable[[], bool] = never,
              probe: Callable[[], tuple[float, ...]] | None = None, drain_s: float = 60.0,
              pause_s: float = 0.0) -> tuple[StepSummary, Tally]:
    """``warmup`` seconds untimed, then ``seconds`` of ``schedule`` timed: the step's summary and its tally (for a
    claim over its latencies). ``probe()`` (the server's CPU, the machine's) is read as the timed part starts and
    ends; its deltas land in ``StepSummary.probe``. ``seed``: the arrivals' (default the schedule's own).
    ``pause_s``: a closed-loop client pauses this long after an answer not accepted (retrying a refusal at once is
    a retry storm that measures the event loop, not the model)."""
    async def step(length: float, record: bool) -> Tally:
        tally = Tally()
        if record and probe is not None:
            before = probe()
        if isinstance(schedule, Closed):
            await _closed(sender, pool, schedule, length, tally, max_requests if record else None, stop, pause_s)
        else:
            await _open(sender, pool, schedule, length, tally, max_in_flight, seed if record else (seed or 0) + 7919,
                        stop, drain_s)
        tally.finish()
        if record and probe is not None:
            tally.probe = [b - a for a, b in zip(before, probe(), strict=True)]
        return tally

    if warmup > 0:
        await step(warmup, False)
    tally = await step(seconds, True)
    return tally.summary(schedule.mode, schedule.level, sender.name, margin_ms), tally
