"""The HTTP server: Open Inference Protocol v2 (KServe/Triton) + an image endpoint, on FastAPI.

Inference runs in worker threads behind the dynamic batcher, never on the
event loop. Every error is a JSON ``{"error": "..."}`` with a 4xx/5xx code that
says what went wrong; bad input never gets a 500 and never stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from servopt import __version__
from servopt.data.preprocess import Preprocess, decode_image
from servopt.errors import UserError
from servopt.serve.batcher import BatchStats, DynamicBatcher, QueueFull
from servopt.serve.model import ServedModel
from servopt.serve.protocol import HEADER, BadRequest, datatype_of, encode_infer_response, parse_infer_request

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096)


@dataclass
class ServeSettings:
    max_batch: int = 32
    max_delay_us: int = 2000
    max_queue: int = 256  # samples waiting; past it: 503 + Retry-After
    request_timeout_s: float = 30.0
    max_body_mb: float = 32.0
    max_image_pixels: int = 40_000_000
    api_key: str | None = None
    batching: bool = True


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("servopt_requests", "HTTP requests by endpoint and status code", ["endpoint", "code"], registry=r)
        self.latency = Histogram("servopt_request_seconds", "request latency inside the server, by status code",
                                 ["endpoint", "code"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("servopt_queue_seconds", "time a request waited in the batching queue", buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram("servopt_compute_seconds", "model execution time per batch", buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("servopt_batch_size", "samples per model call", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.depth = Gauge("servopt_queue_depth", "samples waiting in the batching queues", registry=r)


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


KNOWN_ENDPOINTS = {"v2", "v2/health/live", "v2/health/ready", "v2/models/{name}", "v2/models/{name}/ready",
                   "v2/models/{name}/config", "v2/models/{name}/infer", "v2/models/{name}/classify", "metrics", "docs",
                   "openapi.json"}


def _endpoint(path: str) -> str:
    """The route template of a path, for metric labels. Anything else is "other": a label copied from the raw path
    would let any client create unbounded label values (memory) and inject characters into the exposition."""
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[:2] == ["v2", "models"]:
        parts = ["v2", "models", "{name}", *parts[3:]]
    template = "/".join(parts)
    return template if template in KNOWN_ENDPOINTS else "other"


async def _drain(receive) -> None:
    """Consume and discard a request body (cheap next to parsing it), so the connection stays usable."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class GuardMiddleware:
    """Auth, size limit, readiness and per-request metrics, as plain ASGI.

    Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) wraps every request in extra tasks and
    streams; at hundreds of requests per second on 2 cores that overhead is measurable, so this is written
    against ASGI directly.
    """

    def __init__(self, app, *, settings: ServeSettings, metrics: Metrics, state: dict, max_body: int) -> None:
        self.app, self.settings, self.metrics, self.state, self.max_body = app, settings, metrics, state, max_body
        self.expected_auth = f"Bearer {settings.api_key}".encode() if settings.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path = scope["path"]
        status = {"code": 500}

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        refusal = self._refusal(scope, path)
        try:
            if refusal is not None:
                if refusal.status_code != 413:
                    await _drain(receive)  # read the body first: a client still writing it would block on a full socket
                await refusal(scope, receive, send_and_record)
            else:
                await self.app(scope, receive, send_and_record)
        except Exception as e:  # noqa: BLE001 - the last line of defence: a JSON error, the server stays up
            if status["code"] == 500:
                await _error(500, f"internal error: {type(e).__name__}")(scope, receive, send_and_record)
        finally:
            endpoint = _endpoint(path)
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint, str(status["code"])).observe(time.perf_counter() - start)

    def _refusal(self, scope, path: str) -> JSONResponse | None:
        headers = dict(scope["headers"])
        if (self.expected_auth and not path.startswith("/v2/health")
                and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected_auth)):
            return _error(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return _error(400, "Content-Length is not a number")
            if int(length) > self.max_body:  # not drained: close the connection instead of reading gigabytes
                return _error(413, f"request body of {int(length)} bytes is over the {self.max_body}-byte limit",
                              {"Connection": "close"})
        if scope["method"] == "POST" and not self.state["ready"]:
            return _error(503, "the server is not ready (starting or shutting down)", {"Retry-After": "1"})
        if scope["method"] == "POST" and self.state.get("full", lambda: False)():
            # Refuse before reading the body: under overload, reading megabytes only to refuse them is what
            # makes refusals slow. (The batcher still refuses exactly, after parsing, when a request would overflow.)
            return _error(503, "overloaded: the queue is full; retry later", {"Retry-After": "1"})
        return None


def create_app(models: dict[str, ServedModel], settings: ServeSettings | None = None) -> FastAPI:
    settings = settings or ServeSettings()
    metrics = Metrics()
    batchers: dict[str, DynamicBatcher] = {}
    # Read when scraped, summed over models: nothing to update on the request path.
    metrics.depth.set_function(lambda: sum(b.depth for b in batchers.values()))
    state = {"ready": False}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        for name, m in models.items():
            if not m.sessions:
                await asyncio.get_running_loop().run_in_executor(None, m.load)
            stats = BatchStats(on_batch=lambda n, s: (metrics.batch.observe(n), metrics.compute.observe(s)),
                               on_queue_wait=metrics.queue.observe)
            fns = [lambda feed, s=s: s.run(feed) for s in m.sessions]
            b = DynamicBatcher(fns, max_batch=settings.max_batch if settings.batching else 1,
                               max_delay_us=settings.max_delay_us if settings.batching else 0, max_queue=settings.max_queue, stats=stats)
            b.start()
            batchers[name] = b
        state["full"] = lambda: any(b.depth >= b.max_queue for b in batchers.values())
        state["ready"] = True
        yield
        state["ready"] = False  # graceful shutdown: refuse new work, finish what is queued
        await asyncio.gather(*(b.stop() for b in batchers.values()))

    app = FastAPI(title="servopt inference server", version=__version__, lifespan=lifespan,
                  description="Open Inference Protocol v2 (KServe / Triton) with dynamic batching")
    max_body = int(settings.max_body_mb * 1024 * 1024)

    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics, state=state, max_body=max_body)

    async def read_body(request: Request) -> bytes:
        if request.headers.get("content-length") is not None:
            return await request.body()  # size already checked by GuardMiddleware; one read, no chunk loop
        chunks, size = [], 0
        async for chunk in request.stream():  # chunked upload: enforce the limit as it arrives
            size += len(chunk)
            if size > max_body:
                raise BadRequest(f"request body is over the {max_body}-byte limit", status=413)
            chunks.append(chunk)
        return b"".join(chunks)

    @app.exception_handler(BadRequest)
    async def bad_request(_r: Request, e: BadRequest):
        return _error(e.status, str(e), e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_r: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail) if e.status_code != 404 else "no such route")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_r: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        return _error(400, f"invalid request: {'.'.join(map(str, first.get('loc', [])))} {first.get('msg', '')}".strip())

    def get_model(name: str) -> ServedModel:
        if name not in models:
            raise BadRequest(f"unknown model {name!r}; this server has {sorted(models)}", status=404)
        return models[name]

    async def run_batched(name: str, inputs: dict[str, np.ndarray], arrival) -> np.ndarray:
        try:
            return await asyncio.wait_for(batchers[name].submit(inputs, arrival), settings.request_timeout_s)
        except QueueFull as e:
            raise BadRequest(f"overloaded: {e}; retry later", status=503, headers={"Retry-After": "1"}) from e
        except TimeoutError as e:
            raise BadRequest(f"the request took longer than {settings.request_timeout_s} s", status=504) from e

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        if not state["ready"]:
            return _error(503, "not ready")
        return {"ready": True}

    @app.get("/v2")
    async def server_metadata():
        return {"name": "servopt", "version": __version__, "extensions": ["binary_tensor_data", "classification", "model_configuration"]}

    def tensor_meta(t) -> dict:
        return {"name": t.name, "datatype": datatype_of(t.dtype), "shape": [d if isinstance(d, int) and d > 0 else -1 for d in t.shape]}

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str):
        m = get_model(name)
        platform = "onnxruntime_onnx" if m.artifact["format"] == "onnx" else "openvino"
        return {"name": name, "versions": ["1"], "platform": platform,
                "inputs": [tensor_meta(t) for t in m.spec.inputs], "outputs": [tensor_meta(t) for t in m.spec.outputs]}

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str):
        get_model(name)
        return {"name": name, "ready": state["ready"]}

    @app.get("/v2/models/{name}/config")
    async def model_config(name: str):
        """Triton's model configuration (perf_analyzer reads max_batch_size here); dims exclude the batch axis."""
        m = get_model(name)

        def triton(t) -> dict:
            return {"name": t.name, "data_type": f"TYPE_{datatype_of(t.dtype)}",
                    "dims": [d if isinstance(d, int) and d > 0 else -1 for d in t.shape[1:]]}

        return {"name": name, "platform": "onnxruntime_onnx" if m.artifact["format"] == "onnx" else "openvino",
                "max_batch_size": settings.max_batch, "input": [triton(t) for t in m.spec.inputs],
                "output": [triton(t) for t in m.spec.outputs], "instance_group": [{"count": len(m.sessions) or m.instances, "kind": "KIND_CPU"}],
                "dynamic_batching": {"max_queue_delay_microseconds": settings.max_delay_us} if settings.batching else None}

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request):
        m = get_model(name)
        with batchers[name].arrival() as arrival:
            body = await read_body(request)
            req = parse_infer_request(body, request.headers.get(HEADER), m.spec.inputs)
            if req.requested_outputs and any(o != m.output_name for o in req.requested_outputs):
                raise BadRequest(f"unknown output(s) {req.requested_outputs}; the model gives {[m.output_name]}")
            out = await run_batched(name, req.inputs, arrival)
        content, headers = encode_infer_response(name, req.id, {m.output_name: out}, req.binary_outputs)
        media = "application/octet-stream" if req.binary_outputs else "application/json"
        return Response(content, media_type=media, headers=headers)

    async def decode_for(m: ServedModel, request: Request) -> np.ndarray:
        """The request's image (raw body or multipart ``file``), preprocessed as the model expects."""
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            try:
                form = await request.form(max_part_size=max_body)
            except Exception as e:
                raise BadRequest(f"malformed multipart body: {e}") from e
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise BadRequest("multipart body needs a 'file' part with the image")
            data = await upload.read()
        elif ctype.split(";")[0].strip() in ("image/jpeg", "image/png", "image/webp", "image/bmp", "application/octet-stream", ""):
            data = await read_body(request)
        else:
            raise BadRequest(f"content type {ctype!r} is not an image; send image/jpeg or image/png, or multipart", status=415)
        if not data:
            raise BadRequest("the body is empty; send the image bytes")
        pp = Preprocess.from_dict(m.spec.preprocessing)
        try:
            # Decoding is CPU work: off the event loop, like inference.
            x = await asyncio.get_running_loop().run_in_executor(None, lambda: pp(decode_image(data, settings.max_image_pixels)))
        except UserError as e:
            raise BadRequest(e.problem) from e
        return x

    @app.post("/v2/models/{name}/classify")
    async def classify(name: str, request: Request, top_k: int = 5):
        """JPEG/PNG bytes (raw body or multipart ``file``) → the model's own preprocessing → top-k labels."""
        m = get_model(name)
        if m.spec.task != "classification" or len(m.spec.inputs) != 1 or len(m.spec.inputs[0].shape) != 4:
            raise BadRequest(f"model {name!r} is not an image classifier", status=400)
        if not 1 <= top_k <= 1000:
            raise BadRequest("top_k must be between 1 and 1000")
        with batchers[name].arrival() as arrival:  # on its way from the first byte: decoding is the long part
            x = await decode_for(m, request)
            logits = (await run_batched(name, {m.spec.inputs[0].name: x[None]}, arrival))[0].astype(np.float64)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        order = np.argsort(-probs)[:top_k]
        labels = m.spec.class_names or [str(i) for i in range(len(probs))]
        return {"model_name": name, "predictions": [{"label": labels[i] if i < len(labels) else str(i), "index": int(i),
                                                     "probability": float(probs[i])} for i in order]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    app.state.batchers = batchers
    app.state.models = models
    return app


def api_key_from_env(explicit: str | None) -> str | None:
    return explicit or os.environ.get("SERVOPT_API_KEY") or None
