"""Serving on Ray Serve (``servopt serve SOURCE --ray``): N replicas, or autoscaling, of the same server.

Each replica is a Ray Serve ingress deployment that holds its own ``DataPlane`` over the models and answers HTTP with
the very app ``rest.create_app(plane)`` builds: the routes, errors, auth, size limits and batching are the
single-process server's, not copies. The mechanism is Ray Serve's late-bound ingress (``@serve.ingress()`` with no
app, and ``__serve_build_asgi_app__`` on the class): Ray calls the constructor (which makes the data plane), then
``__serve_build_asgi_app__`` (which returns ``create_app(plane)``), then runs that app's ASGI lifespan with uvicorn's
``LifespanOn`` before the replica takes traffic, so the app's own lifespan starts the batchers (and the metrics
pusher); on shutdown Ray runs the lifespan's shutdown (stop taking work, drain the queue) from the replica's
``__del__``. The constructor loads the models itself: an exception there reaches Serve's status with its message,
where a failed lifespan only says "ASGI lifespan startup failed".

Ray Serve's proxy and router sit in front: they pick a replica (power of two choices on requests in flight), and
each replica batches what reaches it with its own ``DynamicBatcher``, exactly as one process does. The replica's
bounded queue still answers 503 when full; ``max_ongoing_requests`` is set high enough that requests reach that
queue instead of waiting, unbounded, in Ray's router.

``/metrics`` is aggregated: every replica pushes a snapshot of its Prometheus registry to one small ``MetricsHub``
deployment each second, and whichever replica answers ``GET /metrics`` pushes its own fresh one and returns the
hub's sum over replicas (counters, histograms and the queue-depth gauge summed), so one scrape target sees the
whole service and its counters never jump between replicas. ``servopt_ray_replicas`` says how many live replicas
are in the sum; each response carries a ``Servopt-Replica`` header naming the replica that answered.

Ray is optional (``pip install 'servopt[ray]'``): nothing here imports it at module level.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from servopt.errors import UserError
from servopt.serve.dataplane import DataPlane
from servopt.serve.model import ServedModel
from servopt.settings import ServeSettings

log = logging.getLogger(__name__)

APP_NAME = "servopt"
REPLICA_HEADER = "servopt-replica"
RAY_EXTRA = "pip install 'servopt[ray]'"

# A snapshot of a Prometheus registry, picklable and cheap: [(family, type, help, [(sample, labels, value)])].
Snapshot = list[tuple[str, str, str, list[tuple[str, tuple[tuple[str, str], ...], float]]]]


def require_ray() -> None:
    """Ray Serve importable, or a UserError naming the extra."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise UserError(f"--ray needs Ray Serve, which is not installed ({e})", fix=RAY_EXTRA) from e


def parse_autoscale(text: str, max_batch: int) -> dict[str, Any]:
    """``MIN-MAX`` or ``MIN-MAX:TARGET`` → Ray's autoscaling config. TARGET is the requests in flight per replica Ray
    aims for (its queue-length signal); by default ``max_batch``, a full batch per replica."""
    spec, _, target = text.partition(":")
    lo, sep, hi = spec.partition("-")
    try:
        low, high = int(lo), int(hi)
        goal = float(target) if target else float(max_batch)
    except ValueError:
        low = high = -1
        goal = 0.0
    if not sep or low < 0 or high < max(1, low) or goal <= 0:
        raise UserError(f"--autoscale {text!r} is not MIN-MAX[:TARGET] with 0 <= MIN <= MAX, MAX >= 1",
                        fix="e.g. --autoscale 1-4 (target: max-batch requests in flight per replica) or --autoscale 1-4:8")
    return {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": goal}


# metrics ----------------------------------------------------------------------------------------------------------
def snapshot(registry) -> Snapshot:
    return [(m.name, m.type, m.documentation, [(s.name, tuple(sorted(s.labels.items())), float(s.value)) for s in m.samples])
            for m in registry.collect()]


def merge(parts: list[tuple[Snapshot, bool]]) -> Snapshot:
    """Replicas' snapshots summed; each part says whether its replica is live. Counters and histograms add up over
    every replica ever seen (a replica that left keeps its share, so totals never go back); gauges (queue depth) only
    over live ones; ``*_created`` timestamps take the earliest."""
    families: dict[str, tuple[str, str, dict[tuple[str, tuple], float]]] = {}
    for snap, live in parts:
        for name, typ, doc, samples in snap:
            _, _, values = families.setdefault(name, (typ, doc, {}))
            if typ == "gauge" and not live:
                continue
            for sample, labels, value in samples:
                key = (sample, labels)
                if key not in values:
                    values[key] = value
                elif sample.endswith("_created"):
                    values[key] = min(values[key], value)
                else:
                    values[key] += value
    return [(name, typ, doc, [(sample, labels, v) for (sample, labels), v in values.items()])
            for name, (typ, doc, values) in families.items()]


def exposition_of(snap: Snapshot, live_replicas: int) -> bytes:
    """The Prometheus text format of a (merged) snapshot, with ``servopt_ray_replicas``."""
    from prometheus_client import generate_latest
    from prometheus_client.metrics_core import Metric

    families = []
    for name, typ, doc, samples in snap:
        m = Metric(name, doc, typ)
        for sample, labels, value in samples:
            m.add_sample(sample, dict(labels), value)
        families.append(m)
    live = Metric("servopt_ray_replicas", "Ray Serve replicas whose live figures are in this sum", "gauge")
    live.add_sample("servopt_ray_replicas", {}, float(live_replicas))
    families.append(live)

    class Families:
        def collect(self):
            return families

    return generate_latest(Families())  # type: ignore[arg-type]


class MetricsHub:
    """A one-replica deployment that keeps each server replica's latest snapshot and answers their sum.

    A replica that shut down (its final push) is folded into ``retired``, counters only, so memory stays bounded
    however often autoscaling replaces replicas. One that stops pushing without saying so (a crash) keeps its last
    counters but drops out of the gauges after ``stale_after_s``."""

    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.stale_after_s = stale_after_s
        self.replicas: dict[str, tuple[float, Snapshot]] = {}
        self.retired: Snapshot = []

    async def push(self, replica: str, snap: Snapshot, final: bool = False) -> None:
        if final:
            self.replicas.pop(replica, None)
            self.retired = merge([(self.retired, False), (snap, False)])
        else:
            self.replicas[replica] = (time.monotonic(), snap)

    async def exposition(self) -> bytes:
        now = time.monotonic()
        parts = [(snap, now - t < self.stale_after_s) for t, snap in self.replicas.values()]
        return exposition_of(merge([(self.retired, False), *parts]), sum(live for _, live in parts))


# the replica --------------------------------------------------------------------------------------------------------
class ReplicaHeader:
    """ASGI: every response names the replica that made it (``Servopt-Replica``)."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


class MetricsPusher:
    """A ``rest.Frontend`` (started and stopped with the app's lifespan) that pushes this replica's registry to the
    hub every ``interval_s``."""

    def __init__(self, replica: OIPReplica, interval_s: float) -> None:
        self.replica, self.interval_s = replica, interval_s
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                await self.replica.push()
            except Exception as e:  # noqa: BLE001 - the hub restarting must not stop the replica; counted and logged
                self.replica.plane.metrics.push_errors.inc()
                log.warning("metrics push to the hub failed (its /metrics lags for this replica): %s", e)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


class OIPReplica:
    """One Ray Serve replica: a DataPlane over the models and the REST app over it (``rest.create_app``, unchanged).

    Made into a deployment by ``build_application`` (``serve.deployment(serve.ingress()(OIPReplica))``), so this
    module imports without Ray."""

    def __init__(self, models: dict[str, ServedModel], settings: ServeSettings, hub=None, push_interval_s: float = 1.0) -> None:
        from ray import serve

        self.replica = serve.get_replica_context().replica_id.unique_id
        # Copies: Ray keeps (and later pickles, looking for deployment handles) the constructor's arguments, and
        # loaded ONNX Runtime sessions do not pickle.
        self.plane = DataPlane({n: dataclasses.replace(m, sessions=[]) for n, m in models.items()}, settings)
        for m in self.plane.models.values():  # here, not in the lifespan: a model that cannot load says why in Serve's status
            m.load()
        self.hub, self.push_interval_s = hub, push_interval_s

    async def __serve_build_asgi_app__(self):
        from servopt.serve.rest import create_app

        frontends = [MetricsPusher(self, self.push_interval_s)] if self.hub is not None else []
        app = create_app(self.plane, frontends=frontends, exposition=self.exposition if self.hub is not None else None)
        app.add_middleware(ReplicaHeader, replica=self.replica)  # outermost: refusals carry it too
        app.state.replica = self.replica
        return app

    async def push(self, final: bool = False) -> None:
        await self.hub.push.remote(self.replica, snapshot(self.plane.metrics.registry), final)

    async def exposition(self) -> bytes:
        """What ``GET /metrics`` answers: the sum over replicas, this replica's share fresh, the others' at most
        ``push_interval_s`` old."""
        await self.push()
        return await self.hub.exposition.remote()

    async def __del__(self) -> None:
        # Ray calls this after the app's lifespan shutdown (queue drained): the replica's final counters.
        if getattr(self, "hub", None) is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.push(final=True), 2)


# deployment and server --------------------------------------------------------------------------------------------
def deployment_options(models: dict[str, ServedModel], settings: ServeSettings, replicas: int = 1,
                       autoscale: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ray Serve options of the server deployment: replicas or autoscaling; enough requests in flight per replica
    that its own bounded queue (503 when full) decides, not Ray's router; a drain as long as a request may take."""
    if replicas < 1:
        raise UserError(f"--replicas {replicas} must be at least 1", fix="e.g. --replicas 2")
    instances = sum(max(1, m.instances) for m in models.values())
    in_flight = settings.max_queue + settings.max_batch * instances + 16  # queued + running + a few metadata calls
    cpus = max(1, instances * (settings.threads or 1))
    opts: dict[str, Any] = {
        "name": APP_NAME, "max_ongoing_requests": in_flight, "ray_actor_options": {"num_cpus": cpus},
        "graceful_shutdown_timeout_s": settings.request_timeout_s + 5, "max_constructor_retry_count": 1,
    }
    if autoscale:
        opts["autoscaling_config"] = autoscale
    else:
        opts["num_replicas"] = replicas
    return opts


def build_application(models: dict[str, ServedModel], settings: ServeSettings, replicas: int = 1,
                      autoscale: dict[str, Any] | None = None, push_interval_s: float = 1.0):
    """The Ray Serve application: the server deployment (ingress) and the metrics hub it reports to."""
    from ray import serve

    for m in models.values():
        if m.sessions:
            raise UserError(f"model {m.name} is already loaded here", fix="pass models as from_file/from_run made them")
    hub = serve.deployment(name=f"{APP_NAME}-metrics", num_replicas=1, ray_actor_options={"num_cpus": 0},
                           max_ongoing_requests=1000)(MetricsHub)
    server = serve.deployment(**deployment_options(models, settings, replicas, autoscale))(serve.ingress()(OIPReplica))
    return server.bind(models, settings, hub.bind(), push_interval_s)


def check_settings(settings: ServeSettings) -> None:
    if settings.grpc_port:
        raise UserError("--grpc-port is not served under --ray (Ray Serve's proxy speaks HTTP here)",
                        fix="drop --grpc-port, or serve gRPC without --ray")
    if settings.limit_concurrency:
        raise UserError("--limit-concurrency is uvicorn's, and Ray Serve's proxy is not uvicorn",
                        fix="drop it: each replica's bounded queue (--max-queue) refuses excess work with 503")


def _why(error: Exception) -> str:
    """The failing replica's exception line(s) (Serve's own error only says which deployment failed)."""
    import re

    from ray import serve

    text = str(error).strip() or repr(error)
    with contextlib.suppress(Exception):
        for d in serve.status().applications[APP_NAME].deployments.values():
            if d.message.strip():
                text = d.message
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if re.match(r"[\w.]+(Error|Exception)\b.*: ", line)]
    return " ".join(line.strip() for line in lines[starts[-1]:]) if starts else (lines[-1].strip() if lines else repr(error))


def run_ray_server(models: dict[str, ServedModel], settings: ServeSettings, replicas: int = 1,
                   autoscale: dict[str, Any] | None = None, address: str | None = None,
                   on_ready: Callable[[], None] | None = None, stop: threading.Event | None = None) -> None:
    """Serve on Ray Serve, HTTP on ``settings.host:port``, until Ctrl-C, SIGTERM or ``stop``.

    ``address`` None starts a local Ray instance; otherwise ``ray.init(address)`` joins a cluster ("auto",
    "ray://host:10001", …). What this call started it shuts down at the end: Serve and Ray when it started them, only
    this application when they were running already (a cluster, or a Ray this process had initialised)."""
    require_ray()
    check_settings(settings)
    import ray
    from ray import serve

    app = build_application(models, settings, replicas, autoscale)
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(address=address, namespace=APP_NAME, logging_level="WARNING")
    own_serve = own_ray and address is None and not os.environ.get("RAY_ADDRESS")  # a local instance of our own
    previous = None
    if threading.current_thread() is threading.main_thread():
        def interrupt(*_):
            raise KeyboardInterrupt
        previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port,
                                  "request_timeout_s": settings.request_timeout_s + 5},  # the replica's 504 comes first
                    logging_config={"log_level": "WARNING"})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", logging_config={"log_level": "WARNING", "enable_access_log": False})
        except Exception as e:  # a replica that cannot start (unreadable model, bad options): say why, no traceback
            raise UserError(f"Ray Serve could not start the server: {_why(e)}",
                            fix="see the replica's log under the Ray session folder (`ray logs`), or serve without --ray") from e
        if on_ready:
            on_ready()
        while not (stop and stop.wait(0.5)):
            if stop is None:
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(Exception):
            if own_serve:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        if own_ray:
            ray.shutdown()
