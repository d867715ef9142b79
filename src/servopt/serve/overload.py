"""Admission under overload, measured from outside (issue 16): one sample a request encoded once for REST (binary
tensors) and gRPC, Poisson arrivals at a fixed rate whose answers are sorted into accepted, refused at admission and
dropped after waiting, the server's counters from ``/metrics`` and its RSS over the phase, and the goal's checks.

``benchmarks/overload.py`` runs it against ``servopt serve`` at a multiple of the closed-loop maximum (``max_rate``);
the open loop here keeps every status (``serve.loadtest``'s counts errors only) and speaks gRPC too.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from servopt.serve.harness import ServerProcess
from servopt.serve.metrics import metrics_delta, read_metrics
from servopt.serve.protocol import DATATYPES, encode_raw_tensor

COUNTERS = ("servopt_refused_total", "servopt_dropped_total", "servopt_compute_seconds_sum", "servopt_compute_seconds_count",
            "servopt_batch_size_sum")


@dataclass
class Request:
    """One request's tensors, encoded once for both protocols."""

    rest_path: str  # /v2/models/{name}/infer
    rest_body: bytes
    rest_headers: dict[str, str]
    grpc: object  # pb.ModelInferRequest


def make_request(meta: dict) -> Request:
    """One sample for the model ``GET /v2/models/{name}`` describes (dynamic axes 16; a BYTES input: a short sentence),
    as a binary-tensor REST body and a gRPC ``ModelInferRequest``."""
    from servopt.serve.proto import grpc_service_pb2 as pb

    rng = np.random.default_rng(0)
    arrays = {}
    for t in meta["inputs"]:
        shape = [1] + [d if d > 0 else 16 for d in t["shape"][1:]]
        if t["datatype"] == "BYTES":
            arr = np.empty(shape, dtype=object)
            arr[...] = b"A short sentence to embed, as a client would send it."
        else:
            dtype = DATATYPES[t["datatype"]]
            arr = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else np.ones(shape, dtype=dtype)
        arrays[t["name"]] = (t["datatype"], arr)
    raws = {n: encode_raw_tensor(a) for n, (_, a) in arrays.items()}
    header = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": dt, "parameters": {"binary_data_size": len(raws[n])}}
                         for n, (dt, a) in arrays.items()],
              "outputs": [{"name": o["name"], "parameters": {"binary_data": True}} for o in meta["outputs"]]}
    head = json.dumps(header).encode()
    grpc_request = pb.ModelInferRequest(
        model_name=meta["name"], inputs=[pb.ModelInferRequest.InferInputTensor(name=n, datatype=dt, shape=a.shape)
                                         for n, (dt, a) in arrays.items()],
        raw_input_contents=list(raws.values()))
    headers = {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}
    return Request(f"/v2/models/{meta['name']}/infer", head + b"".join(raws.values()), headers, grpc_request)


Send = Callable[[], Awaitable[str]]  # one request → its status ("200", "503", "OK", "RESOURCE_EXHAUSTED", …)
DROPPED = "dropped"  # appended to a 503's status when the server dropped it after waiting (its message says so)


@dataclass
class Phase:
    protocol: str
    rate_rps: float
    duration_s: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    accepted_ms: list[float] = field(default_factory=list)
    refused_ms: list[float] = field(default_factory=list)  # refused at admission: the fast answer to overload
    dropped_ms: list[float] = field(default_factory=list)  # admitted, then dropped for waiting past the budget
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the phase, server RSS)
    skipped_by_client: int = 0  # arrivals not sent: the client's in-flight cap (the client must not become the queue)


async def open_loop(send: Send, ok: str, refused: set[str], phase: Phase, seconds: float, max_in_flight: int = 2048,
                    seed: int = 0, record: bool = True) -> None:
    """Poisson arrivals at ``phase.rate_rps`` for ``seconds``; each request's latency goes to accepted or refused."""
    rng = random.Random(seed)
    in_flight: set[asyncio.Task] = set()

    async def one() -> None:
        start = time.perf_counter()
        status = await send()
        ms = (time.perf_counter() - start) * 1000
        if not record:
            return
        phase.statuses[status] += 1
        if status == ok:
            phase.accepted_ms.append(ms)
        elif status.endswith(DROPPED):
            phase.dropped_ms.append(ms)
        elif status in refused:
            phase.refused_ms.append(ms)

    t = start = time.perf_counter()
    while t < start + seconds:
        t += rng.expovariate(phase.rate_rps)
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(in_flight) >= max_in_flight:
            phase.skipped_by_client += record
            continue
        task = asyncio.create_task(one())
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.wait(set(in_flight), timeout=60)
    if record:
        phase.duration_s = time.perf_counter() - start


def rest_sender(session, url: str, request: Request) -> Send:
    import aiohttp

    async def send() -> str:
        try:
            async with session.post(url, data=request.rest_body, headers=request.rest_headers) as r:
                body = await r.read()
                return f"{r.status} {DROPPED}" if r.status == 503 and b"dropped after waiting" in body else str(r.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            return type(e).__name__

    return send


def grpc_sender(stub, request: Request) -> Send:
    import grpc

    async def send() -> str:
        try:
            await stub.ModelInfer(request.grpc, timeout=60)
            return "OK"
        except grpc.aio.AioRpcError as e:
            dropped = "dropped after waiting" in (e.details() or "")
            return f"{e.code().name} {DROPPED}" if dropped else e.code().name

    return send


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": round(float(np.percentile(values, 50)), 2), "p99": round(float(np.percentile(values, 99)), 2)}


def summarize(phase: Phase, counters: dict[str, float], budget_ms: float) -> dict:
    calls = counters.get("servopt_compute_seconds_count", 0.0)
    call_ms = counters.get("servopt_compute_seconds_sum", 0.0) / calls * 1000 if calls else None
    accepted, refused = percentiles(phase.accepted_ms), percentiles(phase.refused_ms)
    rss = [mb for _, mb in phase.rss_mb]
    growth = (rss[-1] - rss[0]) / rss[0] * 100
    goal = {"accepted_p99_within_budget_plus_one_call": accepted["p99"] is not None and call_ms is not None
            and accepted["p99"] <= budget_ms + call_ms,
            # the excess is what was refused at admission and what was dropped after waiting: both are answers to overload
            "excess_p99_under_20ms": (excess := percentiles(phase.refused_ms + phase.dropped_ms))["p99"] is None or excess["p99"] < 20,
            "rss_growth_under_10pct": growth < 10}
    return {"protocol": phase.protocol, "rate_rps": round(phase.rate_rps, 1), "duration_s": round(phase.duration_s, 1),
            "statuses": dict(phase.statuses), "skipped_by_client": phase.skipped_by_client,
            "accepted_rps": round(len(phase.accepted_ms) / phase.duration_s, 1) if phase.duration_s else 0.0,
            "accepted_ms": accepted, "refused_ms": refused,
            "dropped": {"count": len(phase.dropped_ms), "ms": percentiles(phase.dropped_ms)},
            "server": {"refused": {k.split('"')[1]: v for k, v in counters.items() if k.startswith("servopt_refused_total{")},
                       "dropped": counters.get("servopt_dropped_total", 0.0), "model_calls": int(calls),
                       "mean_call_ms": round(call_ms, 1) if call_ms else None,
                       "mean_batch": round(counters.get("servopt_batch_size_sum", 0.0) / calls, 1) if calls else None},
            "rss_mb": {"start": rss[0], "end": rss[-1], "max": max(rss), "growth_pct": round(growth, 1), "every_5s": phase.rss_mb},
            "goal": goal}


async def max_rate(url: str, request: Request, seconds: float, concurrency: int) -> tuple[float, dict[str, int]]:
    """Accepted requests/s with ``concurrency`` requests always in flight (closed loop, REST), and the statuses seen.
    A refused worker pauses 50 ms before its next request: a closed loop retrying refusals at once is a retry storm
    that measures the event loop, not the model."""
    import aiohttp

    statuses: Counter = Counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        send = rest_sender(session, url, request)

        async def worker(until: float, counts: Counter) -> None:
            while time.perf_counter() < until:
                status = await send()
                counts[status] += 1
                if status != "200":
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(worker(time.perf_counter() + 1.0, Counter()) for _ in range(concurrency)))  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker(start + seconds, statuses) for _ in range(concurrency)))
        return statuses["200"] / (time.perf_counter() - start), dict(statuses)


async def overload(server: ServerProcess, request: Request, protocol: str, rate: float, seconds: float, warmup: float,
                   budget_ms: float) -> dict:
    import aiohttp
    import grpc

    phase = Phase(protocol, rate)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session, \
            grpc.aio.insecure_channel(server.grpc_url) as channel:
        if protocol == "rest":
            send, ok, refused = rest_sender(session, server.url + request.rest_path, request), "200", {"503"}
        else:
            from servopt.serve.proto import grpc_service_pb2_grpc as pb_grpc

            send, ok = grpc_sender(pb_grpc.GRPCInferenceServiceStub(channel), request), "OK"
            refused = {"RESOURCE_EXHAUSTED", "UNAVAILABLE"}
        await open_loop(send, ok, refused, Phase(protocol, rate), warmup, record=False)  # connections, steady state
        before = read_metrics(server.url, COUNTERS)
        sampler = asyncio.create_task(sample_rss(server, phase))
        await open_loop(send, ok, refused, phase, seconds, seed=1)
        sampler.cancel()
        phase.rss_mb.append((round(phase.duration_s, 1), round(server.rss_bytes() / 1e6, 1)))
        after = read_metrics(server.url, COUNTERS)
    return summarize(phase, metrics_delta(before, after), budget_ms)


async def sample_rss(server: ServerProcess, phase: Phase, every_s: float = 5.0) -> None:
    """The server's RSS every few seconds of the phase: growth that levels off (allocator arenas reaching the shapes
    in use) reads differently from growth that does not (a leak)."""
    start = time.perf_counter()
    while True:
        phase.rss_mb.append((round(time.perf_counter() - start, 1), round(server.rss_bytes() / 1e6, 1)))
        await asyncio.sleep(every_s)
