"""Prometheus metrics of the server, shared by every front end (REST and gRPC label their requests by endpoint)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


def parse_metrics(text: str, prefixes: tuple[str, ...] = ("servopt_",)) -> dict[str, float]:
    """The samples of a Prometheus text exposition (``GET /metrics``) whose names start with one of ``prefixes``:
    ``{'name{labels}': value}``. The one reader of the server's counters for the load generators and benchmarks."""
    out: dict[str, float] = {}
    for line in text.split("\n"):
        if line.startswith(prefixes):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue  # not a sample line
    return out


def read_metrics(url: str, prefixes: tuple[str, ...] = ("servopt_",), timeout_s: float = 10.0,
                 api_key: str | None = None) -> dict[str, float]:
    """``parse_metrics`` of the server at ``url`` now ({} when it has no ``/metrics``, or it cannot be read)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s, headers=headers)
    except httpx.HTTPError:
        return {}
    return parse_metrics(r.text, prefixes) if r.status_code == 200 else {}


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter gained between two readings (a sample absent before counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("servopt_requests", "requests by endpoint and status code", ["endpoint", "code"], registry=r)
        self.latency = Histogram("servopt_request_seconds", "request latency inside the server, by status code",
                                 ["endpoint", "code"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("servopt_queue_seconds", "time a request waited in the batching queue", buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram("servopt_compute_seconds", "model execution time per batch", buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("servopt_batch_size", "samples per model call", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.depth = Gauge("servopt_queue_depth", "samples waiting in the batching queues", registry=r)
        # Overload: what admission by expected wait refused at once, and what was dropped after waiting past the budget.
        self.refused = Counter("servopt_refused", "requests refused at admission (503) by reason: expected_wait (over the "
                               "latency budget), queue_full (over max_queue samples)", ["reason"], registry=r)
        self.dropped = Counter("servopt_dropped", "queued requests dropped (503) for waiting past the latency budget", registry=r)
        self.expected_wait = Gauge("servopt_expected_wait_seconds", "how long a request arriving now would wait for its "
                                   "model call (the longest over models): what admission compares with the budget", registry=r)
        # Text models: tokens per batch, real and padding (waste = padding / real; tokens/s = rate of real).
        self.tokens = Counter("servopt_tokens", "tokens run by text models, by kind (real, padding)", ["kind"], registry=r)
        self.truncated = Counter("servopt_truncated_texts", "texts cut to the model's maximum length", registry=r)
        # Ray Serve replicas: snapshots of this registry that could not reach the hub (/metrics then lags for this one)
        self.push_errors = Counter("servopt_metrics_push_errors", "metric snapshots a replica could not push to the hub", registry=r)
        self._children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}

    def observe_request(self, endpoint: str, code: int | str, seconds: float) -> None:
        # The labelled children, kept: ``labels()`` takes a lock and builds its key on every call. Bounded: endpoints
        # are route templates (or "other") and codes HTTP statuses.
        key = (endpoint, str(code))
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (self.requests.labels(*key), self.latency.labels(*key))
        children[0].inc()
        children[1].observe(seconds)
