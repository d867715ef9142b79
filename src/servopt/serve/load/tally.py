"""One tally for every load: each request's scheduled, sent and answered times and its answer's kind, summed up as
one ``StepSummary`` (the typed figures of a step that ``servopt loadtest``, the capacity search, the overload check
and the served comparisons all read).

Latency runs from each request's **scheduled** time, not from when the client got round to sending it: a client that
falls behind its schedule (its event loop busy, its process waiting for a core the server holds) would otherwise hide
the queue it should have measured (coordinated omission; LoadGen and wrk2 time from the schedule for this reason). How
far behind the client fell is measured too (``lag``: sent minus scheduled), with its own CPU time: a step where more
than ``BEHIND_SHARE`` of the requests went out later than the stated margin measured the client as much as the server,
and is not valid.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, Field

from servopt.serve.load.senders.base import Answer, Kind

BEHIND_SHARE = 0.01  # of the requests sent later than the margin: past it the client fell behind its schedule
# without a latency bound to scale it by (servopt loadtest without --slo): a bare client on this shared 2-vCPU machine
# (load average 4-5) sent its p99 request 5 ms late from the OS scheduler alone (AMD EPYC Zen 4, 2026-11-29)
DEFAULT_MARGIN_MS = 10.0


class Percentiles(BaseModel):
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None

    @classmethod
    def of(cls, values: list[float] | np.ndarray) -> Percentiles:
        if len(values) == 0:
            return cls()
        arr = np.asarray(values, dtype=np.float64)
        p = np.percentile(arr, [50, 90, 95, 99])
        return cls(p50=float(p[0]), p90=float(p[1]), p95=float(p[2]), p99=float(p[3]), mean=float(arr.mean()))


class ClientFigures(BaseModel):
    """The load generator's own share of the step: its CPU and how late it sent against its schedule."""

    cpu_ms_per_request: float | None  # the client process's CPU (user + system) per request sent
    cpu_share: float  # of one core over the step
    lag_ms: Percentiles  # sent minus scheduled
    margin_ms: float  # a request sent later than this after its scheduled time was sent late
    behind_share: float  # of the requests sent late
    unsent: int  # arrivals never sent: the in-flight cap (the client must not become the queue)


class StepSummary(BaseModel):
    """One step of load: what was sent, what came back in which words, and how fast."""

    mode: str  # "closed", "open-poisson", "open-constant"
    concurrency: int | None = None
    rate_rps: float | None = None
    sender: str
    duration_s: float
    sent: int
    ok: int  # accepted
    refused: int
    dropped: int
    failed: int  # errors: other statuses, broken connections, no answer in time
    errors: dict[str, int] = Field(default_factory=dict)  # every answer but an accepted one, by status
    throughput_rps: float  # accepted per second
    latency_ms: Percentiles  # accepted, from each request's scheduled time
    late_latency_ms: Percentiles | None = None  # accepted among those scheduled in the step's second half
    refused_ms: Percentiles | None = None
    dropped_ms: Percentiles | None = None
    client: ClientFigures
    valid: bool
    invalid: str | None = None  # why not
    probe: list[float] = Field(default_factory=list)  # what the caller's probe counted over the step (server CPU …)
    server: dict | None = None  # the server's own figures over the step, where the caller read them (/metrics)

    @property
    def not_accepted(self) -> int:
        return self.refused + self.dropped + self.failed + self.client.unsent


@dataclass
class Tally:
    """Each request of a step as it is answered (``add``), and the arrivals not sent (``unsent``)."""

    scheduled: list[float] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    done: list[float] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    unsent: int = 0
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    cpu0: float = field(default_factory=time.process_time)
    cpu: float = 0.0
    probe: list[float] = field(default_factory=list)

    def add(self, scheduled: float, sent: float, done: float, answer: Answer) -> None:
        self.scheduled.append(scheduled)
        self.sent.append(sent)
        self.done.append(done)
        self.answers.append(answer)

    def finish(self) -> None:
        self.ended = time.perf_counter()
        self.cpu = time.process_time() - self.cpu0

    def summary(self, mode: str, level: float, sender: str, margin_ms: float = DEFAULT_MARGIN_MS) -> StepSummary:
        ended = self.ended if self.ended is not None else time.perf_counter()
        duration = max(ended - self.started, 1e-9)
        scheduled, done = np.asarray(self.scheduled), np.asarray(self.done)
        latency = (done - scheduled) * 1000 if len(done) else np.asarray([])
        lag = (np.asarray(self.sent) - scheduled) * 1000 if len(done) else np.asarray([])
        kinds = np.asarray([a.kind.value for a in self.answers])
        ok = kinds == Kind.ACCEPTED.value
        late_half = scheduled >= self.started + (ended - self.started) / 2 if len(done) else np.asarray([], dtype=bool)
        statuses = Counter(a.status for a in self.answers if a.kind is not Kind.ACCEPTED)
        counts = Counter(kinds.tolist())
        sent = len(self.answers)
        behind = float((lag > margin_ms).mean()) if sent else 0.0
        invalid = []
        if self.unsent:
            invalid.append(f"{self.unsent} arrivals not sent (the client's in-flight cap)")
        if behind > BEHIND_SHARE:
            invalid.append(f"the client sent {behind:.1%} of its requests over {margin_ms:g} ms behind their schedule "
                           f"(p99 {np.percentile(lag, 99):.1f} ms)")

        def pct(mask: np.ndarray) -> Percentiles | None:
            return Percentiles.of(latency[mask]) if mask.any() else None

        closed = mode == "closed"
        return StepSummary(
            mode=mode, concurrency=int(level) if closed else None, rate_rps=None if closed else float(level), sender=sender,
            duration_s=round(duration, 4), sent=sent, ok=int(ok.sum()), refused=counts.get(Kind.REFUSED.value, 0),
            dropped=counts.get(Kind.DROPPED.value, 0), failed=counts.get(Kind.ERROR.value, 0), errors=dict(statuses),
            throughput_rps=float(ok.sum()) / duration, latency_ms=Percentiles.of(latency[ok]) if sent else Percentiles(),
            late_latency_ms=pct(ok & late_half) if sent else None,
            refused_ms=pct(kinds == Kind.REFUSED.value) if sent else None,
            dropped_ms=pct(kinds == Kind.DROPPED.value) if sent else None,
            client=ClientFigures(cpu_ms_per_request=self.cpu * 1000 / sent if sent else None, cpu_share=self.cpu / duration,
                                 lag_ms=Percentiles.of(lag), margin_ms=margin_ms, behind_share=behind, unsent=self.unsent),
            valid=not invalid, invalid="; ".join(invalid) or None, probe=self.probe)

    def latencies_ms(self) -> tuple[list[float], int]:
        """The accepted requests' latencies from their schedule, and how many were not accepted."""
        lat = [(d - s) * 1000 for s, d, a in zip(self.scheduled, self.done, self.answers, strict=True) if a.kind is Kind.ACCEPTED]
        return lat, len(self.answers) - len(lat) + self.unsent

    def late_latencies_ms(self) -> tuple[list[float], int]:
        """``latencies_ms`` of the requests scheduled in the step's second half."""
        ended = self.ended if self.ended is not None else time.perf_counter()
        half = self.started + (ended - self.started) / 2
        lat, missing = [], 0
        for s, d, a in zip(self.scheduled, self.done, self.answers, strict=True):
            if s >= half:
                if a.kind is Kind.ACCEPTED:
                    lat.append((d - s) * 1000)
                else:
                    missing += 1
        return lat, missing


def percentile_of(summary: Percentiles, percentile: int) -> float | None:
    value = getattr(summary, f"p{percentile}", None)
    return None if value is None or math.isnan(value) else value
