"""Settings of each command family, declared once: defaults here, overridden by ``SERVOPT_*`` environment
variables, overridden by the command line (which passes only what the user typed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServeSettings(BaseSettings):
    """``servopt serve`` and what ``servopt package`` writes into a deployable (``SERVOPT_MAX_BATCH=64`` …)."""

    model_config = SettingsConfigDict(env_prefix="SERVOPT_", extra="ignore")
    # Where and how this server is reached (and its secret): chosen where it is deployed, never written into a package.
    DEPLOYMENT: ClassVar[frozenset[str]] = frozenset({"host", "port", "grpc_port", "api_key"})

    host: str = "127.0.0.1"  # bind address; 127.0.0.1 unless you mean to expose it
    port: int = 8000
    grpc_port: int | None = None  # the OIP v2 gRPC service, off unless asked
    max_batch: int = 32  # largest merged batch
    max_delay_us: int = 2000  # how long a request may wait to be batched
    max_queue: int = 256  # samples allowed to wait (a memory bound); past it 503, a request larger than it 413
    # The longest a request may wait for its model call: a request expected to wait longer is refused at once (503 +
    # Retry-After), a queued one that waited longer is dropped (503). 0: no bound on the wait, only max_queue.
    latency_budget_ms: float = Field(default=1000.0, ge=0)
    batching: bool = True
    instances: int | None = None  # model instances (default: from the target's objective)
    threads: int | None = None  # intra-op threads per instance
    request_timeout_s: float = 30.0
    max_body_mb: float = 32.0
    max_image_pixels: int = 40_000_000
    max_request_samples: int = 2048  # samples (texts, images) in one request; past it 413
    max_batch_tokens: int = 16384  # text models: padded tokens in one merged batch (requests grouped by length under it)
    # Text models on a CPU: a model call stops merging requests past this many padded tokens (its first request always
    # goes). Past a few hundred tokens a bigger call is no faster per token on a CPU, it only makes the requests in it
    # wait: all-MiniLM-L6-v2 INT8 on one AVX2 core, 2.16 ms a 13-token text at 8 a call vs 2.11 at 32; a 128-token
    # text 24.8 ms alone vs 26.8 at 32 a call. 0: only max_batch and max_batch_tokens bound a call (GPU runtimes).
    max_call_tokens: int = Field(default=512, ge=0)
    max_padding: float | None = Field(default=0.25, ge=0)  # text models: a merged batch is split into model calls padding at most this share
    api_key: str | None = None  # SERVOPT_API_KEY: require 'Authorization: Bearer KEY'
    limit_concurrency: int | None = None  # uvicorn's limit on connections + requests in progress

    def packaged(self) -> dict[str, Any]:
        """What ``servopt package`` records in a manifest: every setting but the deployment's own (``DEPLOYMENT``), so
        a new setting travels with packages without a second list to keep."""
        return self.model_dump(exclude=set(self.DEPLOYMENT))


def parse_duration(text: str | None) -> float | None:
    """``300``, ``300s``, ``5m``, ``1.5h`` → seconds; None, ``none`` and ``off`` → None (no limit). Raises ValueError
    naming the form."""
    if text is None or str(text).strip() == "":
        return None
    raw = str(text).strip().lower()
    if raw in ("none", "off"):
        return None
    scale = {"s": 1, "m": 60, "h": 3600}.get(raw[-1])
    number = raw[:-1] if scale else raw
    try:
        seconds = float(number) * (scale or 1)
    except ValueError as e:
        raise ValueError(f"{text!r} is not a duration: use seconds (300), or 300s, 5m, 1h") from e
    if seconds <= 0:
        raise ValueError(f"{text!r}: a duration must be positive")
    return seconds


def parse_rate(text: str | None) -> float | None:
    """``500``, ``500/s``, ``30000/min``, ``1.8M/h`` → inferences per second; None stays None."""
    if text is None or str(text).strip() == "":
        return None
    raw = str(text).strip().lower().replace(" ", "")
    number, _, per = raw.partition("/")
    scale = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "hour": 3600}.get(per)
    mult = {"k": 1e3, "m": 1e6}.get(number[-1:], 1) if number else 1
    try:
        value = float(number[:-1] if mult != 1 else number) * mult
    except ValueError as e:
        raise ValueError(f"{text!r} is not a rate: use e.g. 500/s, 30000/min or 1.8M/h") from e
    if scale is None or value <= 0:
        raise ValueError(f"{text!r} is not a rate: use e.g. 500/s, 30000/min or 1.8M/h")
    return value / scale


DEFAULT_BUDGET = "30m"  # servopt optimize's time budget unless told otherwise (--budget none lifts it)


class OptimizeSettings(BaseSettings):
    """``servopt optimize`` and ``servopt demo`` (``SERVOPT_OPTIMIZE_TARGETS=cpu-server`` …)."""

    model_config = SettingsConfigDict(env_prefix="SERVOPT_OPTIMIZE_", extra="ignore")

    out: Path = Path("runs/optimize")
    targets: str = "cpu-server,gpu-server,edge"
    variants: list[str] | None = None
    include_all: bool = False
    calibration_samples: int = 100
    quick: bool = False  # tiny timing phases: a smoke run, figures not for decisions
    interleave_rounds: int = 3
    verify_max_drop: float = 5.0  # a variant further than this from the original is failed, not timed
    verify_min_agreement: float = 0.9
    verify_min_cosine: float = 0.99
    note: str = ""  # shown at the top of the report
    full: bool = False  # no race: every variant built, measured and cold-started (slower; the same decisions)
    lab: bool = False  # also the lab's ladder (text: plain / eval / no_grad / compile)
    # A time budget for the whole sweep (300, 300s, 5m, 1h; none: no limit): by default an answer in half an hour, the
    # likeliest winners first, a build or measurement still running at its end stopped and listed (--full: none).
    budget: str | None = DEFAULT_BUDGET
    load: str | None = None  # a load to price: 500, 500/s, 30000/min (instances and USD a month per target)
    # no served-capacity search: priced targets' picks are not served to find their capacity within the SLO
    # (max_p99_ms); their prices and throughput bounds come from the offline figures, projected
    no_capacity: bool = False
    ray: str | None = None  # a distributed sweep: the Ray cluster (auto, ray://HOST:10001, HOST:6379, local); None: this machine

    @field_validator("budget")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        parse_duration(value)
        return value

    @field_validator("load")
    @classmethod
    def _rate(cls, value: str | None) -> str | None:
        parse_rate(value)
        return value

    @property
    def budget_seconds(self) -> float | None:
        return parse_duration(self.budget)

    @property
    def load_ips(self) -> float | None:
        return parse_rate(self.load)
