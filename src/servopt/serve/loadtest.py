"""``servopt loadtest``: closed loop at fixed concurrencies, open loop at a fixed rate (MLPerf's server scenario).

The load generator shares the machine with the server here, so it is kept
cheap: one asyncio process, aiohttp keep-alive connections, the request body
encoded once (Triton binary tensors by default). Every step is bounded in time
and count and sends only to the address it is given. Per step it reports
throughput, latency percentiles, errors by kind, and the server's own
queue/compute split read from ``/metrics`` before and after.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from servopt.errors import UserError
from servopt.serve.metrics import parse_metrics
from servopt.serve.protocol import DATATYPES


@dataclass
class Payload:
    path: str
    body: bytes
    headers: dict[str, str]


def infer_payload(meta: dict, batch: int = 1, binary: bool = True, seed: int = 0) -> Payload:
    """A v2 infer request for the model described by ``GET /v2/models/{name}``."""
    rng = np.random.default_rng(seed)
    inputs, blobs = [], []
    for t in meta["inputs"]:
        shape = [batch] + [d if d > 0 else 16 for d in t["shape"][1:]]
        dtype = DATATYPES[t["datatype"]]
        arr = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else np.ones(shape, dtype=dtype)
        entry = {"name": t["name"], "shape": shape, "datatype": t["datatype"]}
        if binary:
            raw = arr.tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        inputs.append(entry)
    header = {"inputs": inputs}
    if binary:
        header["outputs"] = [{"name": o["name"], "parameters": {"binary_data": True}} for o in meta["outputs"]]
    head = json.dumps(header).encode()
    headers = {"Content-Type": "application/octet-stream" if binary else "application/json"}
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(head))
    return Payload(f"/v2/models/{meta['name']}/infer", head + b"".join(blobs), headers)


def json_payload(path: str, body: dict) -> Payload:
    return Payload(path, json.dumps(body).encode(), {"Content-Type": "application/json"})


def image_payload(model: str, image: Path) -> Payload:
    return Payload(f"/v2/models/{model}/classify", image.read_bytes(), {"Content-Type": "image/jpeg" if image.suffix.lower() in (".jpg", ".jpeg") else "image/png"})


@dataclass
class StepResult:
    mode: str
    level: float  # concurrency or rate
    duration_s: float
    latencies_ms: list[float] = field(default_factory=list)
    sent_s: list[float] = field(default_factory=list)  # when each answered request was sent (perf_counter)
    started: float = field(default_factory=time.perf_counter)
    refused_ms: list[float] = field(default_factory=list)  # how fast 503s came back
    errors: dict[str, int] = field(default_factory=dict)
    dropped: int = 0

    def late_percentiles(self) -> dict[str, float] | None:
        """Percentiles of the requests sent in the step's second half: a queue that builds over the step (a rate
        the server cannot sustain) shows there, where the whole step's figure averages it with a calm start."""
        if not self.sent_s or self.duration_s <= 0:
            return None
        half = self.started + self.duration_s / 2
        late = [lat for lat, sent in zip(self.latencies_ms, self.sent_s, strict=True) if sent >= half]
        return {p: float(np.percentile(late, int(p[1:]))) for p in ("p50", "p90", "p95", "p99")} if late else None

    def summary(self, server: dict | None) -> dict:
        lat = np.asarray(self.latencies_ms) if self.latencies_ms else np.asarray([np.nan])
        ok = len(self.latencies_ms)
        return {
            "mode": self.mode, self_key(self.mode): self.level, "duration_s": round(self.duration_s, 3), "ok": ok,
            "errors": self.errors, "dropped_by_client": self.dropped, "throughput_rps": ok / self.duration_s if self.duration_s else 0.0,
            "latency_ms": {p: float(np.nanpercentile(lat, int(p[1:]))) for p in ("p50", "p90", "p95", "p99")} | {"mean": float(np.nanmean(lat))},
            "refused_latency_ms": {p: float(np.percentile(self.refused_ms, int(p[1:]))) for p in ("p50", "p99")} if self.refused_ms else None,
            "late_latency_ms": self.late_percentiles(),
            "server": server,
        }


def self_key(mode: str) -> str:
    return "concurrency" if mode == "closed" else "rate_rps"


def _parse_metrics(text: str) -> dict[str, float]:
    """The request-latency buckets, and the queue/compute/batch sums and counts (not their buckets)."""
    wanted = ("servopt_request_seconds_bucket", "servopt_queue_seconds_", "servopt_compute_seconds_", "servopt_batch_size_")
    return {k: v for k, v in parse_metrics(text, wanted).items() if k.startswith(wanted[0]) or "bucket" not in k}


def _server_percentiles(before: dict[str, float], after: dict[str, float], code: str) -> dict | None:
    """p50/p99 of the server's own request latency for one status code, from histogram deltas
    (bucket upper bounds: "at most"). On a shared machine the client's view includes its own backlog."""
    buckets: dict[float, float] = {}
    for key, value in after.items():
        if not key.startswith("servopt_request_seconds_bucket") or f'code="{code}"' not in key:
            continue
        if "/infer" not in key and "/classify" not in key:  # inference endpoints only, not /metrics polls
            continue
        le = key.split('le="')[1].split('"')[0]
        bound = float("inf") if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + value - before.get(key, 0.0)
    if not buckets or max(buckets.values()) <= 0:
        return None
    total = buckets[float("inf")] if float("inf") in buckets else max(buckets.values())

    def at_most(q: float) -> float | None:
        for bound in sorted(buckets):
            if buckets[bound] >= q * total:
                return None if bound == float("inf") else bound * 1000
        return None

    return {"count": int(total), "p50_ms_at_most": at_most(0.5), "p99_ms_at_most": at_most(0.99)}


def server_split(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """Mean queue wait, mean compute per batch and mean batch size over the step, from /metrics deltas."""
    def delta(k: str) -> float:
        return after.get(k, 0.0) - before.get(k, 0.0)

    batches = delta("servopt_compute_seconds_count")
    if batches <= 0:
        return None
    waits = delta("servopt_queue_seconds_count")
    return {"mean_queue_ms": delta("servopt_queue_seconds_sum") / waits * 1000 if waits else None,
            "mean_compute_ms_per_batch": delta("servopt_compute_seconds_sum") / batches * 1000,
            "mean_batch_size": delta("servopt_batch_size_sum") / batches, "batches": int(batches),
            "server_latency": {code: p for code in ("200", "503") if (p := _server_percentiles(before, after, code))}}


class LoadGenerator:
    def __init__(self, url: str, payload: Payload, api_key: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.payload = payload
        self.headers = dict(payload.headers)
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s

    async def _one(self, session, result: StepResult | None) -> None:
        import aiohttp

        start = time.perf_counter()
        try:
            async with session.post(self.url + self.payload.path, data=self.payload.body, headers=self.headers) as r:
                await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            status = type(e).__name__
        if result is None:
            return
        if status == 200:
            result.latencies_ms.append((time.perf_counter() - start) * 1000)
            result.sent_s.append(start)
        else:
            if status == 503:
                result.refused_ms.append((time.perf_counter() - start) * 1000)
            key = f"http {status}" if isinstance(status, int) else status
            result.errors[key] = result.errors.get(key, 0) + 1

    async def metrics(self, session) -> dict[str, float]:
        """The server's Prometheus figures; {} when it has none. Retried once: a pooled keep-alive connection
        the server closed while idle (uvicorn closes them after 5 s) fails on first use."""
        import aiohttp

        for attempt in range(2):
            try:
                async with session.get(self.url + "/metrics", headers=self.headers) as r:
                    return _parse_metrics(await r.text()) if r.status == 200 else {}
            except (aiohttp.ClientError, TimeoutError):
                if attempt:
                    return {}
        return {}

    async def closed(self, session, concurrency: int, duration: float, max_requests: int, warmup: float) -> dict:
        async def worker(result: StepResult | None, until: float, budget: list[int]) -> None:
            while time.perf_counter() < until and budget[0] > 0:
                budget[0] -= 1
                await self._one(session, result)

        if warmup > 0:
            await asyncio.gather(*(worker(None, time.perf_counter() + warmup, [10**9]) for _ in range(concurrency)))
        before = await self.metrics(session)
        result = StepResult("closed", concurrency, 0.0)
        start = result.started = time.perf_counter()
        await asyncio.gather(*(worker(result, start + duration, [max(1, max_requests // concurrency)]) for _ in range(concurrency)))
        result.duration_s = time.perf_counter() - start
        return result.summary(server_split(before, await self.metrics(session)))

    async def open(self, session, rate: float, duration: float, distribution: str, max_in_flight: int, warmup: float,
                   seed: int = 0) -> dict:
        rng = random.Random(seed)
        in_flight: set[asyncio.Task] = set()

        async def run(result: StepResult | None, length: float) -> None:
            t = time.perf_counter()
            end = t + length
            while t < end:
                t += rng.expovariate(rate) if distribution == "poisson" else 1.0 / rate
                delay = t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if len(in_flight) >= max_in_flight:  # never let the client itself become the queue
                    if result is not None:
                        result.dropped += 1
                    continue
                task = asyncio.create_task(self._one(session, result))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            if in_flight:
                await asyncio.wait(set(in_flight), timeout=self.timeout_s)

        if warmup > 0:
            await run(None, warmup)
        before = await self.metrics(session)
        result = StepResult(f"open-{distribution}", rate, 0.0)
        start = result.started = time.perf_counter()
        await run(result, duration)
        result.duration_s = time.perf_counter() - start
        return result.summary(server_split(before, await self.metrics(session)))


async def fetch_metadata(url: str, model: str, api_key: str | None) -> dict:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as s:
        try:
            async with s.get(f"{url.rstrip('/')}/v2/models/{model}", headers=headers) as r:
                if r.status == 404:
                    raise UserError(f"the server at {url} has no model {model!r}", fix="check --model")
                if r.status != 200:
                    raise UserError(f"GET /v2/models/{model} answered {r.status}: {await r.text()}", fix="check the server")
                return await r.json()
        except aiohttp.ClientError as e:
            raise UserError(f"cannot reach {url}: {e}", fix="start the server (`servopt serve …`) or fix the URL") from e


async def run_loadtest(url: str, model: str, *, concurrency: list[int] | None = None, rate: list[float] | None = None,
                       distribution: str = "poisson", duration: float = 20.0, warmup: float = 3.0, max_requests: int = 1_000_000,
                       binary: bool = True, batch: int = 1, image: Path | None = None, api_key: str | None = None,
                       max_in_flight: int = 1024, on_step=lambda s: None) -> dict:
    import aiohttp

    payload = image_payload(model, image) if image else infer_payload(await fetch_metadata(url, model, api_key), batch, binary)
    gen = LoadGenerator(url, payload, api_key)
    steps = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=gen.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for c in concurrency or []:
            steps.append(await gen.closed(session, c, duration, max_requests, warmup))
            on_step(steps[-1])
        for r in rate or []:
            steps.append(await gen.open(session, r, duration, distribution, max_in_flight, warmup))
            on_step(steps[-1])
    return {"schema": "servopt.loadtest/1", "url": url, "model": model, "endpoint": payload.path,
            "binary": binary and image is None, "batch": batch, "steps": steps}
