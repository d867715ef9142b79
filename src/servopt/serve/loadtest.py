"""``servopt loadtest``: closed loop at fixed concurrencies, open loop at fixed rates (MLPerf's server scenario), with
the load generator of ``serve.load`` (the cheapest sender by default: it shares the machine with the server).

What it sends: the user's texts (``--texts``, one a request) or images (``--image``: a file or a folder, to
``/classify``), else one sample made from the model's metadata (Triton binary tensors by default). Per step it
reports throughput, latency percentiles from each request's scheduled time, the answers in the load generator's words
(accepted, refused, dropped, errors), the client's own CPU and lag, and the server's own queue/compute split read
from ``/metrics`` before and after.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from servopt.serve.load import Closed, Open, Pool, Request, open_sender, run
from servopt.serve.load import requests as R
from servopt.serve.metrics import read_metrics
from servopt.serve.ratesearch import fetch_metadata

METRICS = ("servopt_request_seconds_bucket", "servopt_queue_seconds_", "servopt_compute_seconds_", "servopt_batch_size_")


def _server_metrics(url: str, api_key: str | None) -> dict[str, float]:
    """The request-latency buckets, and the queue/compute/batch sums and counts (not their buckets)."""
    values = read_metrics(url, METRICS, api_key=api_key)
    return {k: v for k, v in values.items() if k.startswith(METRICS[0]) or "bucket" not in k}


def _server_percentiles(before: dict[str, float], after: dict[str, float], code: str) -> dict | None:
    """p50/p99 of the server's own request latency for one status code, from histogram deltas
    (bucket upper bounds: "at most"). On a shared machine the client's view includes its own backlog."""
    buckets: dict[float, float] = {}
    for key, value in after.items():
        if not key.startswith("servopt_request_seconds_bucket") or f'code="{code}"' not in key:
            continue
        if "/infer" not in key and "/classify" not in key and "/embed" not in key:  # inference endpoints, not /metrics
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


def loadtest_requests(url: str, model: str, api_key: str | None, *, binary: bool = True, batch: int = 1,
                      image: Path | None = None, texts: Path | None = None, grpc: bool = False) -> tuple[list[Request], str]:
    """What ``servopt loadtest`` sends, and that in words."""
    if image is not None:
        files = R.image_files(image)
        return R.image_requests(model, files), f"{len(files)} image file(s) to /classify"
    meta = fetch_metadata(url, model, api_key)
    if texts is not None:
        from servopt.data.text import read_texts

        lines = read_texts(texts)[:4096]
        return R.text_requests(meta, lines, grpc), f"{len(lines)} texts of {texts}, one a request"
    return ([R.tensor_request(meta, R.synthetic_sample(meta, batch), binary=binary, grpc=grpc)],
            f"one {'binary' if binary else 'JSON'} tensor request of {batch} sample(s) made from the metadata")


async def run_loadtest(url: str, model: str, *, concurrency: list[int] | None = None, rate: list[float] | None = None,
                       distribution: str = "poisson", duration: float = 20.0, warmup: float = 3.0, max_requests: int = 1_000_000,
                       binary: bool = True, batch: int = 1, image: Path | None = None, texts: Path | None = None,
                       api_key: str | None = None, max_in_flight: int = 1024, sender: str = "raw",
                       grpc_url: str | None = None, on_step: Callable[[dict], None] = lambda s: None) -> dict:
    """Every step in turn, each with its warm-up; the steps' summaries (``StepSummary``) with the server's split."""
    requests, what = loadtest_requests(url, model, api_key, binary=binary, batch=batch, image=image, texts=texts,
                                       grpc=sender == "grpc")
    pool = Pool(requests)
    schedules = [Closed(c) for c in concurrency or []] + [Open(r, distribution) for r in rate or []]  # type: ignore[arg-type]
    steps: list[dict] = []
    async with open_sender(sender, grpc_url if sender == "grpc" and grpc_url else url, api_key) as client:
        for i, schedule in enumerate(schedules):
            if warmup > 0:  # its own run, so the server's counters are read between it and the timed one
                await run(client, pool, schedule, warmup, max_in_flight=max_in_flight, seed=1000 + i)
            before = _server_metrics(url, api_key)
            summary, _ = await run(client, pool.reseed(i), schedule, duration, max_in_flight=max_in_flight,
                                   max_requests=max_requests, seed=i)
            out = summary.model_copy(update={"server": server_split(before, _server_metrics(url, api_key))})
            steps.append(out.model_dump(mode="json"))
            on_step(steps[-1])
    return {"schema": "servopt.loadtest/2", "url": url, "model": model, "requests": what, "sender": sender,
            "endpoint": requests[0].path, "binary": binary and image is None and texts is None, "batch": batch,
            "steps": steps}

