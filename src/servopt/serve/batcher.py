"""Dynamic batching: merge concurrent requests into one model call, as Triton's dynamic batcher does.

Requests wait at most ``max_delay_us`` after the first one arrives, to be
merged into a batch of at most ``max_batch`` samples; a request may carry
several samples, and each caller gets exactly its own rows back. For models
whose inputs have a sequence length (text), a batch is also held to
``max_batch_tokens`` padded tokens, and requests of similar length are batched
together (the oldest request always goes first; the others are taken nearest in
length to it), so short texts are not padded to a long one's length — TEI's
``max-batch-tokens`` plus the length bucketing it does not do. A single request
over the token budget is split into calls that fit it, and answered whole.

Admission bounds the wait, not only the count (Triton's queue policy with a
timeout and REJECT): with a latency budget, ``submit`` estimates how long a new
request would wait before its model call starts — from the work queued and in
flight and the measured service time (``ServiceTime``) — and raises
``Overloaded`` at once when that is over the admission share of the budget; a
queued request that has waited past the budget anyway is dropped (``Overloaded``)
before it runs, so no accepted request waits longer than the budget. The sample
bound (``max_queue``) stays as a memory bound; a request bigger than it could
never be queued and raises ``TooLarge``. Model calls run in worker threads, one
per model instance, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np


class Overloaded(Exception):
    """Refused (or dropped) to keep waits under the latency budget, or the queue is full; ``retry_after`` is the
    estimated seconds until there is room, ``kind`` the metric label (``expected_wait``, ``queue_full``, ``waited``)."""

    def __init__(self, message: str, kind: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.kind, self.retry_after = kind, retry_after


class ShuttingDown(Exception):
    pass


class TooLarge(Exception):
    """A request that could never be queued or run as one (more samples than the queue holds; one sequence over the
    token budget): retrying will not help, a smaller request will."""


# Admission stops at this share of the budget: the rest absorbs the estimate's error, so that a request admitted at
# the edge rarely waits past the budget and is dropped after all (a slow refusal).
ADMIT_SHARE = 0.8


class ServiceTime:
    """The seconds a model call takes for ``units`` of work (samples; padded tokens for sequence models): an
    exponentially weighted least-squares line ``fixed + per_unit × units`` over recent calls.

    A line, not a per-sample mean, because batching is what makes a model cheaper per sample: a per-sample mean taken
    at batch 1 would overstate a queue of full batches several times over. While every call has the same size (full
    batches under overload) the spread is nil and the line goes through the origin, which is exact for full batches.
    The first observations count as a running mean (weight 1/n) until that falls below ``weight``, so a seed
    (a timed warm-up call) is replaced by real calls at once."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight, self.count = weight, 0
        self._n = self._t = self._nn = self._nt = 0.0

    def observe(self, units: float, seconds: float) -> None:
        if units <= 0 or seconds < 0:
            return
        self.count += 1
        w = max(self.weight, 1.0 / self.count)
        self._n += w * (units - self._n)
        self._t += w * (seconds - self._t)
        self._nn += w * (units * units - self._nn)
        self._nt += w * (units * seconds - self._nt)

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds per call, seconds per unit), or None before any observation."""
        if not self.count or self._n <= 0:
            return None
        spread = self._nn - self._n * self._n
        if spread > 1e-6 * self._n * self._n:
            slope = (self._nt - self._n * self._t) / spread
            fixed = self._t - slope * self._n
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, self._t / self._n

    def seconds(self, units: float, calls: int = 1) -> float:
        """Estimated seconds of ``calls`` model calls running ``units`` in all (0 before any observation)."""
        line = self.line()
        if line is None:
            return 0.0
        return calls * line[0] + units * line[1]


INFERENCE_NICENESS = 5
# A call shorter than this on one core gains nothing from more threads that sleep between operators (the serving
# sessions do not spin): MiniLM INT8 on an AVX2 EPYC, one thread vs two, 13 tokens 2.8 vs 3.0 ms, 24 tokens 4.7 vs
# 4.1, 128 tokens 25.6 vs 18.1 (same run); and servopt serve with the solo session for every lone call lost 8-19 %
# req/s on short texts at concurrency 8-32 (benchmarks/text_servers.py --servopt-b-args). Only a call of one request
# goes solo: a merged batch means requests keep coming (at concurrency 32, 128 tokens, batches that went solo in a
# gap between arrivals overlapped the next call on the other instance: 0.85x req/s).
SOLO_MIN_SECONDS = 0.004


def lower_priority() -> None:
    """Run this inference thread at a lower CPU priority than the event loop (Linux: per-thread niceness).

    Under overload the model would otherwise take every core and starve the loop that reads requests and
    refuses the excess; with the loop ahead, refusals stay fast and accepted latency stays near the queue's
    bound, while inference still gets all the CPU the loop leaves idle."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), INFERENCE_NICENESS)


PR_SET_NAME = 15  # <linux/prctl.h>
INFERENCE_THREAD_PREFIX = "servopt-infer"  # the model-call threads' names: servopt-infer_0, _1, … (≤ 15 bytes)


def name_native_thread() -> None:
    """Give this thread its Python name at the OS level too (Linux ``comm``, at most 15 bytes): Python 3.11 names only
    its own object, so ``top -H``, ``perf`` and ``/proc/<pid>/task/*/comm`` would show every thread as ``python``;
    named, a server's CPU splits into its inference threads and the event loop (docs/serving.md, "Where a request's CPU goes")."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux (no prctl): the name stays Python's own
        ctypes.CDLL(None).prctl(PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0)


def inference_thread_setup() -> None:
    """An inference worker's start: a lower priority than the event loop, and an OS-level name."""
    lower_priority()
    name_native_thread()


@dataclass
class _Pending:
    inputs: dict[str, np.ndarray]
    size: int
    future: asyncio.Future
    length: int = 0  # sequence length (0: the model has no such axis)
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def units(self) -> int:
        """Work, in the service-time estimate's units: samples, or padded tokens for sequence models."""
        return self.size * max(1, self.length)


class Arrival:
    """A request counted as arriving from when the server starts reading it until it is queued (or fails)."""

    def __init__(self, batcher: DynamicBatcher) -> None:
        self.batcher, self.open = batcher, False

    def __enter__(self) -> Arrival:
        self.batcher.arriving += 1
        self.open = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.open:
            self.open = False
            self.batcher.arriving -= 1


@dataclass
class BatchStats:
    """Hooks the server turns into Prometheus metrics."""

    on_batch: Callable[[int, float], None] = lambda size, compute_s: None
    on_queue_wait: Callable[[float], None] = lambda seconds: None
    on_refused: Callable[[str], None] = lambda kind: None  # refused at admission: expected_wait, queue_full
    on_dropped: Callable[[], None] = lambda: None  # queued, then dropped for waiting past the budget


def _concatenate(feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(feeds) == 1:
        return feeds[0]
    return {n: np.concatenate([f[n] for f in feeds]) for n in feeds[0]}


def _units(group: list[_Pending]) -> int:
    """A model call's work: its samples, times the padded length for sequence models."""
    return sum(p.size for p in group) * max(1, max(p.length for p in group))


class DynamicBatcher:
    def __init__(self, run_fns: list[Callable[[dict[str, np.ndarray]], np.ndarray]], *,
                 collate: Callable[[list[dict[str, np.ndarray]]], dict[str, np.ndarray]] | None = None, max_batch: int = 32,
                 max_delay_us: int = 2000, max_queue: int = 256, stats: BatchStats | None = None,
                 length: Callable[[dict[str, np.ndarray]], int | None] | None = None, max_batch_tokens: int | None = None,
                 max_padding: float | None = None, latency_budget_s: float | None = None,
                 service: ServiceTime | None = None, solo_fn: Callable[[dict[str, np.ndarray]], np.ndarray] | None = None,
                 max_call_tokens: int | None = None) -> None:
        self.run_fns = run_fns
        # A model call with every core, taken instead of an instance's when the call would run alone (no other call in
        # flight, nothing queued): instances split the cores for throughput, which a lone request does not need.
        self.solo_fn = solo_fn
        self.collate = collate or _concatenate
        self.length = length or (lambda _feed: None)
        self.max_batch_tokens = max_batch_tokens
        # sequence models: padded tokens past which a call stops merging (its first request always goes); the bound a
        # call is cut at is the lower of the two
        self.call_tokens = min((t for t in (max_batch_tokens, max_call_tokens) if t), default=None)
        self.max_padding = max_padding  # sequence models: padded tokens per real token one model call may carry
        self.max_batch = max(1, max_batch)
        self.max_delay = max_delay_us / 1e6
        self.max_queue = max_queue
        self.budget = latency_budget_s  # the longest a request may wait for its model call; None: no bound on the wait
        self.service = service or ServiceTime()
        self.stats = stats or BatchStats()
        self.queue: deque[_Pending] = deque()
        self.queued_samples = 0
        self.queued_units = 0
        self.arriving = 0  # requests inside the server (being read/parsed) that will be submitted soon
        self._running: dict[int, tuple[int, int, float]] = {}  # worker → (units left, calls left, when its call started)
        self._wakeup: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    @property
    def depth(self) -> int:
        return self.queued_samples

    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=len(self.run_fns), thread_name_prefix=INFERENCE_THREAD_PREFIX,
                                            initializer=inference_thread_setup)
        self._tasks = [asyncio.create_task(self._worker(i, fn)) for i, fn in enumerate(self.run_fns)]

    async def stop(self) -> None:
        """Finish what is queued, then stop (graceful shutdown)."""
        self._closing = True
        while self.queue:
            await asyncio.sleep(0.005)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._executor.shutdown(wait=True)

    def arrival(self) -> Arrival:
        """``with batcher.arrival() as a: parse; await submit(inputs, a)`` tells the batcher a request is on its
        way, so it waits for it (up to max_delay) instead of dispatching a batch without it."""
        return Arrival(self)

    # admission ------------------------------------------------------------------------------------------------
    def expected_wait(self, now: float | None = None) -> float:
        """Seconds a request arriving now would wait before its model call starts: what is left of the calls in
        flight plus the calls the queued work makes, shared by the instances (0 while one is idle and nothing waits)."""
        workers = len(self.run_fns)
        if not self.queue and len(self._running) < workers:
            return 0.0
        now = time.perf_counter() if now is None else now
        left = sum(max(0.0, self.service.seconds(units, calls) - (now - started))
                   for units, calls, started in self._running.values())
        calls = math.ceil(self.queued_samples / self.max_batch)
        if self.call_tokens:
            calls = max(calls, math.ceil(self.queued_units / self.call_tokens))
        return (left + self.service.seconds(self.queued_units, calls)) / workers

    def check_size(self, samples: int, length: int = 0) -> None:
        """``TooLarge`` for a request that no queue state would ever let through."""
        if samples > self.max_queue:
            raise TooLarge(f"{samples} samples in one request; the queue holds at most {self.max_queue} "
                           "(send fewer per request, or raise --max-queue)")
        if length and self.max_batch_tokens and length > self.max_batch_tokens:
            raise TooLarge(f"one sequence of {length} tokens is over the {self.max_batch_tokens}-token batch budget "
                           "(raise SERVOPT_MAX_BATCH_TOKENS)")

    def admit(self, samples: int = 1) -> None:
        """Refuse now what the queue cannot take, or what would wait past the admission share of the budget
        (``Overloaded``, counted); front ends call it before reading a body, ``submit`` again with the real size."""
        if self._closing:
            raise ShuttingDown("the server is shutting down")
        if self.queued_samples + samples > self.max_queue:
            self.stats.on_refused("queue_full")
            raise Overloaded(f"the queue is full ({self.queued_samples} samples waiting, limit {self.max_queue})",
                             "queue_full", retry_after=self.expected_wait())
        if self.budget is not None:
            wait, limit = self.expected_wait(), ADMIT_SHARE * self.budget
            if wait > limit:
                self.stats.on_refused("expected_wait")
                raise Overloaded(f"a new request would wait about {wait * 1000:.0f} ms; the latency budget is "
                                 f"{self.budget * 1000:.0f} ms", "expected_wait", retry_after=wait - limit)

    def _split(self, inputs: dict[str, np.ndarray], size: int, length: int) -> list[tuple[dict[str, np.ndarray], int]]:
        """A sequence request over the token budget as row slices that each fit it (answered whole, in order)."""
        if not (length and self.max_batch_tokens and size * length > self.max_batch_tokens):
            return [(inputs, size)]
        rows = max(1, self.max_batch_tokens // length)
        return [({n: a[i:i + rows] for n, a in inputs.items()}, min(rows, size - i)) for i in range(0, size, rows)]

    async def submit(self, inputs: dict[str, np.ndarray], arrival: Arrival | None = None) -> np.ndarray:
        size = len(next(iter(inputs.values())))
        length = self.length(inputs) or 0
        self.check_size(size, length)
        self.admit(size)
        loop, now = asyncio.get_running_loop(), time.perf_counter()
        pending = [_Pending(feed, rows, loop.create_future(), length, now) for feed, rows in self._split(inputs, size, length)]
        for p in pending:
            self.queue.append(p)
            self.queued_samples += p.size
            self.queued_units += p.units
        if arrival is not None:
            arrival.close()
        assert self._wakeup is not None
        self._wakeup.set()
        if len(pending) == 1:
            return await pending[0].future
        try:
            return np.concatenate([await p.future for p in pending])
        finally:  # one part failed or the caller gave up: the others are not run
            for p in pending:
                if not p.future.done():
                    p.future.cancel()

    # batching -------------------------------------------------------------------------------------------------
    async def _collect(self) -> list[_Pending]:
        """Wait for a first request, then up to max_delay for more, up to max_batch samples."""
        assert self._wakeup is not None
        while not self.queue:
            self._wakeup.clear()
            await self._wakeup.wait()
        deadline = self.queue[0].enqueued + self.max_delay
        # Wait for company only while some is on its way: a lone request (concurrency 1) is not taxed max_delay.
        while (self.queued_samples < self.max_batch and self.arriving > 0
               and not (self.call_tokens and self.queued_units >= self.call_tokens)
               and (remaining := deadline - time.perf_counter()) > 0):
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                break
        return self._take()

    def _unqueue(self, p: _Pending) -> None:
        self.queued_samples -= p.size
        self.queued_units -= p.units

    def _sweep(self, now: float) -> None:
        """Forget requests whose callers gave up (timeout), and drop those that already waited past the budget:
        running them would only answer late, and delay everyone behind them."""
        kept: deque[_Pending] = deque()
        for p in self.queue:
            if p.future.done():
                self._unqueue(p)
            elif self.budget is not None and (waited := now - p.enqueued) > self.budget:
                self._unqueue(p)
                self.stats.on_dropped()
                p.future.set_exception(Overloaded(
                    f"dropped after waiting {waited * 1000:.0f} ms in the queue, past the {self.budget * 1000:.0f} ms "
                    "latency budget", "waited", retry_after=self.expected_wait(now)))
            else:
                kept.append(p)
        self.queue = kept

    def _take(self) -> list[_Pending]:
        """The next batch: the oldest request, then (FIFO, or nearest in length for sequence models) as many others as
        fit ``max_batch`` samples and ``call_tokens`` padded tokens."""
        self._sweep(time.perf_counter())
        if not self.queue:
            return []
        first = self.queue.popleft()
        batch, samples, longest = [first], first.size, first.length
        rest = list(self.queue)
        if first.length:
            rest.sort(key=lambda p: (abs(p.length - first.length), p.enqueued))
        taken: set[int] = set()
        for p in rest:
            width = max(longest, p.length)
            if samples + p.size > self.max_batch:
                if not first.length:
                    break  # FIFO: no overtaking for models without a sequence axis
                continue
            if self.call_tokens and first.length and width * (samples + p.size) > self.call_tokens:
                continue
            batch.append(p)
            taken.add(id(p))
            samples, longest = samples + p.size, width
        if taken:
            self.queue = deque(p for p in self.queue if id(p) not in taken)
        for p in batch:
            self._unqueue(p)
        return batch

    async def _worker(self, index: int, run_fn: Callable[[dict[str, np.ndarray]], np.ndarray]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if not batch:
                continue
            now = time.perf_counter()
            for p in batch:
                self.stats.on_queue_wait(now - p.enqueued)
            groups = self._by_length(batch)
            units_left = sum(_units(g) for g in groups)
            for i, group in enumerate(groups):
                merged = self.collate([p.inputs for p in group])
                units = _units(group)
                alone = (self.solo_fn is not None and len(batch) == 1 and not self._running and not self.queue
                         and not self.arriving and self.service.seconds(units) >= SOLO_MIN_SECONDS)
                start = time.perf_counter()
                self._running[index] = (units_left, len(groups) - i, start)
                try:
                    out = await loop.run_in_executor(self._executor, self.solo_fn if alone else run_fn, merged)
                except Exception as e:  # noqa: BLE001 - a failed batch fails its callers, not the server
                    for p in group:
                        if not p.future.done():
                            p.future.set_exception(e)
                    continue
                finally:
                    units_left -= units
                    self._running.pop(index, None)
                seconds = time.perf_counter() - start
                # Solo calls feed the estimate too: it also decides which calls go solo, and fed only by the others it
                # kept its seed (one warm-up call, extrapolated) at concurrency 1, sending short calls solo for good.
                # Solo calls run only on an idle server, so the estimate they lower is not the one a queue waits on.
                self.service.observe(units, seconds)
                self.stats.on_batch(sum(p.size for p in group), seconds)
                row = 0
                for p in group:  # each caller gets its own rows, in order
                    if not p.future.done():
                        p.future.set_result(out[row:row + p.size])
                    row += p.size

    def _by_length(self, batch: list[_Pending]) -> list[list[_Pending]]:
        """A collected batch of sequence requests split into model calls of similar lengths, so none pads more than
        ``max_padding`` of its tokens: on a CPU a transformer's cost follows the tokens it runs, padding included,
        so two calls of similar lengths beat one call padded to the longest (measured: 4.9 padded tokens per real
        one at batch 32 in arrival order, 0.3 sorted)."""
        if self.max_padding is None or len(batch) < 2 or not batch[0].length:
            return [batch]
        ordered = sorted(batch, key=lambda p: p.length)
        groups, current = [], [ordered[0]]
        for p in ordered[1:]:
            real = sum(q.length * q.size for q in current) + p.length * p.size
            if p.length * (sum(q.size for q in current) + p.size) > (1 + self.max_padding) * real:
                groups.append(current)
                current = [p]
            else:
                current.append(p)
        return [*groups, current]
