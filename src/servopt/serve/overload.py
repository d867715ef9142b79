"""Admission under overload, measured from outside (issue 16): one sample a request encoded once for REST (binary
tensors) and gRPC, Poisson arrivals at a fixed rate from the load generator (``serve.load``: its answers sorted into
accepted, refused at admission and dropped after waiting), the server's counters from ``/metrics`` and its RSS over
the phase, and the goal's checks.

``benchmarks/overload.py`` runs it against ``servopt serve`` at a multiple of the closed-loop maximum (``max_rate``).
"""

from __future__ import annotations

import asyncio

from servopt.serve.harness import ServerProcess
from servopt.serve.load import Closed, Open, Pool, Request, StepSummary, open_sender, run
from servopt.serve.load.requests import synthetic_sample, tensor_request
from servopt.serve.metrics import metrics_delta, read_metrics

COUNTERS = ("servopt_refused_total", "servopt_dropped_total", "servopt_compute_seconds_sum", "servopt_compute_seconds_count",
            "servopt_batch_size_sum")


def make_request(meta: dict) -> Request:
    """One sample for the model ``GET /v2/models/{name}`` describes (dynamic axes 16; a BYTES input: a short sentence),
    as a binary-tensor REST body and a gRPC ``ModelInferRequest``."""
    return tensor_request(meta, synthetic_sample(meta), binary=True, grpc=True)


def percentiles(values) -> dict[str, float | None]:
    """p50 and p99 of a step's ``Percentiles`` (or none), rounded."""
    if values is None or values.p50 is None:
        return {"p50": None, "p99": None}
    return {"p50": round(values.p50, 2), "p99": round(values.p99, 2)}


def summarize(step: StepSummary, counters: dict[str, float], budget_ms: float, rss_mb: list[tuple[float, float]]) -> dict:
    """A phase's figures and the goal's checks: accepted p99 within the budget and one model call, the excess (refused
    at admission or dropped after waiting) answered in under 20 ms at p99, RSS growth under 10 %."""
    calls = counters.get("servopt_compute_seconds_count", 0.0)
    call_ms = counters.get("servopt_compute_seconds_sum", 0.0) / calls * 1000 if calls else None
    accepted, refused, dropped = percentiles(step.latency_ms), percentiles(step.refused_ms), percentiles(step.dropped_ms)
    excess = max((v for v in (refused["p99"], dropped["p99"]) if v is not None), default=None)
    rss = [mb for _, mb in rss_mb]
    growth = (rss[-1] - rss[0]) / rss[0] * 100
    goal = {"accepted_p99_within_budget_plus_one_call": accepted["p99"] is not None and call_ms is not None
            and accepted["p99"] <= budget_ms + call_ms,
            # the excess is what was refused at admission and what was dropped after waiting: both are answers to overload
            "excess_p99_under_20ms": excess is None or excess < 20,
            "rss_growth_under_10pct": growth < 10}
    return {"protocol": "grpc" if step.sender == "grpc" else "rest", "rate_rps": round(step.rate_rps or 0.0, 1),
            "duration_s": round(step.duration_s, 1), "statuses": {"accepted": step.ok, **step.errors},
            "unsent": step.client.unsent, "accepted_rps": round(step.throughput_rps, 1), "accepted_ms": accepted,
            "refused_ms": refused, "dropped": {"count": step.dropped, "ms": dropped},
            "client": {"cpu_ms_per_request": step.client.cpu_ms_per_request, "lag_p99_ms": step.client.lag_ms.p99,
                       "valid": step.valid, "invalid": step.invalid},
            "server": {"refused": {k.split('"')[1]: v for k, v in counters.items() if k.startswith("servopt_refused_total{")},
                       "dropped": counters.get("servopt_dropped_total", 0.0), "model_calls": int(calls),
                       "mean_call_ms": round(call_ms, 1) if call_ms else None,
                       "mean_batch": round(counters.get("servopt_batch_size_sum", 0.0) / calls, 1) if calls else None},
            "rss_mb": {"start": rss[0], "end": rss[-1], "max": max(rss), "growth_pct": round(growth, 1), "every_5s": rss_mb},
            "goal": goal}


async def max_rate(url: str, request: Request, seconds: float, concurrency: int) -> tuple[float, dict[str, int]]:
    """Accepted requests/s with ``concurrency`` requests always in flight (closed loop, REST), and the answers seen.
    A refused client pauses 50 ms before its next request: a closed loop retrying refusals at once is a retry storm
    that measures the event loop, not the model."""
    async with open_sender("raw", url) as sender:
        step, _ = await run(sender, Pool([request]), Closed(concurrency), seconds, warmup=1.0, pause_s=0.05)
    return step.throughput_rps, {"accepted": step.ok, **step.errors}


async def overload(server: ServerProcess, request: Request, protocol: str, rate: float, seconds: float, warmup: float,
                   budget_ms: float) -> dict:
    """Poisson arrivals at ``rate`` for ``seconds`` (after ``warmup`` uncounted) over ``protocol`` (rest or grpc)."""
    url = server.grpc_url if protocol == "grpc" else server.url
    rss: list[tuple[float, float]] = []
    async with open_sender("grpc" if protocol == "grpc" else "raw", url) as sender:
        pool = Pool([request])
        await run(sender, pool, Open(rate, seed=0), warmup)  # connections, steady state
        before = read_metrics(server.url, COUNTERS)
        sampler = asyncio.create_task(sample_rss(server, rss))
        step, _ = await run(sender, pool, Open(rate, seed=1), seconds, drain_s=60.0)
        sampler.cancel()
        rss.append((round(step.duration_s, 1), round(server.rss_bytes() / 1e6, 1)))
        after = read_metrics(server.url, COUNTERS)
    return summarize(step, metrics_delta(before, after), budget_ms, rss)


async def sample_rss(server: ServerProcess, rss: list[tuple[float, float]], every_s: float = 5.0) -> None:
    """The server's RSS every few seconds of the phase: growth that levels off (allocator arenas reaching the shapes
    in use) reads differently from growth that does not (a leak)."""
    import time

    start = time.perf_counter()
    while True:
        rss.append((round(time.perf_counter() - start, 1), round(server.rss_bytes() / 1e6, 1)))
        await asyncio.sleep(every_s)
