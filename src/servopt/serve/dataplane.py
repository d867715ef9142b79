"""The data plane: what the server does, independent of how requests arrive.

Front ends (REST in ``rest``, gRPC in ``grpc_server``) only move bytes: they
decode a request into the typed ``InferRequest`` (or hand over raw bytes for a
family's convenience endpoint), call the data plane, and encode its answer.
Checking tensors against the model, batching, metadata, Triton's model config,
readiness and the family's convenience endpoint live here once, so a second
front end reuses them without copying (MLServer's ``handlers/dataplane.py``).
Every problem with a request is a ``BadRequest`` that each front end maps to
its own status through its ``Reason`` (HTTP 4xx/503, gRPC ``INVALID_ARGUMENT`` …);
never a 500. Admission by expected wait (the latency budget) is the batcher's;
the data plane turns its refusals into ``Reason.OVERLOADED`` with a Retry-After.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
from typing import Any

import numpy as np

from servopt import __version__
from servopt.errors import UserError
from servopt.machine import Device
from servopt.serve.batcher import Arrival, BatchStats, DynamicBatcher, Overloaded, ServiceTime, ShuttingDown, TooLarge
from servopt.serve.metrics import Metrics
from servopt.serve.model import ServedModel
from servopt.serve.protocol import (
    BadRequest,
    InferRequest,
    InferResponse,
    ModelMetadata,
    Reason,
    ServerMetadata,
    TensorMetadata,
    datatype_of,
    decode_json,
)
from servopt.settings import ServeSettings
from servopt.spec import TensorSpec

EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration"]


def _dims(shape: list) -> list[int]:
    return [d if isinstance(d, int) and d > 0 else -1 for d in shape]


class DataPlane:
    def __init__(self, models: dict[str, ServedModel], settings: ServeSettings, metrics: Metrics | None = None) -> None:
        self.models, self.settings = models, settings
        self.metrics = metrics or Metrics()
        self.batchers: dict[str, DynamicBatcher] = {}
        self.ready = False
        self._served: dict[str, tuple[ServedModel, list[TensorSpec]]] = {}
        # Read when scraped, summed over models: nothing to update on the request path.
        self.metrics.depth.set_function(lambda: sum(b.depth for b in self.batchers.values()))
        self.metrics.expected_wait.set_function(lambda: max((b.expected_wait() for b in self.batchers.values()), default=0.0))

    # lifecycle ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        s = self.settings
        for name, m in self.models.items():
            if not m.sessions:
                await loop.run_in_executor(None, m.load)
            stats = BatchStats(on_batch=lambda n, secs: (self.metrics.batch.observe(n), self.metrics.compute.observe(secs)),
                               on_queue_wait=self.metrics.queue.observe,
                               on_refused=lambda kind: self.metrics.refused.labels(kind).inc(), on_dropped=self.metrics.dropped.inc)
            fns = [self._runner(sess) for sess in m.sessions]
            service = await loop.run_in_executor(None, self._seed_service_time, m)
            b = DynamicBatcher(fns, collate=m.family.collate, max_batch=s.max_batch if s.batching else 1,
                               max_delay_us=s.max_delay_us if s.batching else 0, max_queue=s.max_queue, stats=stats,
                               length=m.family.sequence_length, max_batch_tokens=s.max_batch_tokens, max_padding=s.max_padding,
                               latency_budget_s=s.latency_budget_ms / 1000 if s.latency_budget_ms else None, service=service,
                               solo_fn=self._runner(m.solo) if m.solo is not None else None,
                               max_call_tokens=s.max_call_tokens if m.backend.device == Device.CPU else None)
            b.start()
            self.batchers[name] = b
        self.ready = True

    async def stop(self) -> None:
        """Graceful shutdown: refuse new work, finish what is queued."""
        self.ready = False
        await asyncio.gather(*(b.stop() for b in self.batchers.values()))

    @staticmethod
    def _seed_service_time(m: ServedModel) -> ServiceTime:
        """The service-time estimate before the first request: one timed call of a single sample (after the load's
        warm-up call). Conservative: it assumes no gain from batching, which the first real batches then show."""
        service = ServiceTime()
        feed = m.warm_feed(1)
        start = time.perf_counter()
        m.sessions[0].run(feed)
        service.observe(max(1, m.family.sequence_length(feed) or 1), time.perf_counter() - start)
        return service

    def _runner(self, session):
        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            self._count_tokens(feed)
            return session.run(feed)

        return run

    def _count_tokens(self, feed: dict[str, np.ndarray]) -> None:
        """Real and padding tokens of every batch a text model runs (padding waste and tokens/s in /metrics)."""
        mask = feed.get("attention_mask")
        if mask is not None:
            real = int(mask.sum())
            self.metrics.tokens.labels("real").inc(real)
            self.metrics.tokens.labels("padding").inc(mask.size - real)

    def admit(self, name: str) -> None:
        """Refuse a request for model ``name`` before reading its body when even one more sample would wait past the
        latency budget or overflow the queue (503 + Retry-After; gRPC ``RESOURCE_EXHAUSTED``): under overload,
        reading megabytes only to refuse them is what makes refusals slow. Unknown models pass (answered later)."""
        b = self.batchers.get(name)
        if b is None:
            return
        try:
            b.admit(1)
        except (Overloaded, ShuttingDown) as e:
            raise _refusal(e) from e

    def require_ready(self) -> None:
        """Refuse work while starting or shutting down (503; gRPC ``UNAVAILABLE``)."""
        if not self.ready:
            raise BadRequest("the server is not ready (starting or shutting down)", Reason.UNAVAILABLE, retry_after=1)

    # auth -------------------------------------------------------------------------------------------------------
    def authorized(self, authorization: str | bytes | None) -> bool:
        """Whether a request's ``Authorization`` value (an HTTP header, gRPC metadata) carries the bearer token;
        always when no key is set. Compared in constant time. Health checks are exempt: each front end skips them."""
        key = self.settings.api_key
        if not key:
            return True
        if authorization is None:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "surrogateescape")
        return hmac.compare_digest(authorization, f"Bearer {key}".encode())

    # metadata ---------------------------------------------------------------------------------------------------
    def server_metadata(self) -> ServerMetadata:
        return ServerMetadata(version=__version__, extensions=EXTENSIONS)

    def model(self, name: str) -> ServedModel:
        if name not in self.models:
            raise BadRequest(f"unknown model {name!r}; this server has {sorted(self.models)}", Reason.NOT_FOUND)
        return self.models[name]

    def model_ready(self, name: str) -> bool:
        self.model(name)
        return self.ready

    def model_metadata(self, name: str) -> ModelMetadata:
        m = self.model(name)

        def meta(t: TensorSpec) -> TensorMetadata:
            return TensorMetadata(name=t.name, datatype=datatype_of(t.dtype), shape=_dims(t.shape))

        served = m.family.served_inputs(m.spec)
        params = dict(m.parameters)
        if served != m.spec.inputs:  # e.g. a text encoder: strings in, tokenized here; its token inputs work too
            params["also_accepts"] = ", ".join(f"{t.name} ({datatype_of(t.dtype)})" for t in m.spec.inputs)
        return ModelMetadata(name=name, platform=m.backend.triton_platform, inputs=[meta(t) for t in served],
                             outputs=[meta(t) for t in m.spec.outputs], parameters=params)

    def model_config(self, name: str) -> dict[str, Any]:
        """Triton's model configuration (perf_analyzer reads max_batch_size here); dims exclude the batch axis."""
        m = self.model(name)

        def triton(t: TensorSpec) -> dict[str, Any]:
            return {"name": t.name, "data_type": f"TYPE_{datatype_of(t.dtype)}", "dims": _dims(t.shape[1:])}

        s = self.settings
        return {"name": name, "platform": m.backend.triton_platform, "max_batch_size": s.max_batch,
                "input": [triton(t) for t in m.family.served_inputs(m.spec)], "output": [triton(t) for t in m.spec.outputs],
                "instance_group": [{"count": len(m.sessions) or m.instances, "kind": "KIND_CPU"}],
                "dynamic_batching": {"max_queue_delay_microseconds": s.max_delay_us} if s.batching else None,
                "parameters": {k: {"string_value": str(v)} for k, v in m.parameters.items()}}

    # inference --------------------------------------------------------------------------------------------------
    def arrival(self, name: str) -> Arrival:
        """``with plane.arrival(name) as a: read; await plane.infer(name, req, a)``: the batcher waits for a request
        it knows is on its way (up to max_delay) instead of dispatching a batch without it."""
        self.model(name)
        return self.batchers[name].arrival()

    def served_inputs(self, m: ServedModel) -> list[TensorSpec]:
        """``m``'s family's served inputs, made once per model: the family builds pydantic specs on every call."""
        known = self._served.get(m.name)
        if known is None or known[0] is not m:
            known = self._served[m.name] = (m, m.family.served_inputs(m.spec))
        return known[1]

    def validate(self, m: ServedModel, request: InferRequest) -> tuple[dict[str, np.ndarray], bool]:
        """The request's tensors checked against what the model is served with (its family's served inputs, e.g. text
        strings) or its own inputs: names, datatypes, shapes, finite values, the number of samples. True when the
        family prepares them (``model_inputs``: a text encoder tokenizes strings and checks raw token ids)."""
        served = {t.name: t for t in self.served_inputs(m)}
        as_served = any(t.name in served for t in request.inputs) or served.keys() == {t.name for t in m.spec.inputs}
        expected = served if as_served else {t.name: t for t in m.spec.inputs}
        inputs: dict[str, np.ndarray] = {}
        for tensor in request.inputs:
            name = tensor.name
            if name not in expected:
                raise BadRequest(f"unknown input {name!r}; the model takes {sorted(expected)}")
            if name in inputs:
                raise BadRequest(f"input {name!r} given twice")
            spec = expected[name]
            want = datatype_of(spec.dtype)
            if tensor.datatype != want:
                raise BadRequest(f"input {name!r} has datatype {tensor.datatype}; the model expects {want}")
            shape = tensor.shape
            if len(spec.shape) == 1 and len(shape) == 2 and shape[1] == 1:  # [n, 1] for a per-sample scalar, as Triton
                shape = shape[:1]
                tensor = tensor.model_copy(update={"shape": shape, "data": tensor.data.reshape(shape)})
            if len(shape) != len(spec.shape):
                raise BadRequest(f"input {name!r} has {len(shape)} dimensions {shape}; the model expects "
                                 f"{len(spec.shape)} {_dims(spec.shape)}")
            if shape[0] < 1:
                raise BadRequest(f"input {name!r}: the batch dimension must be at least 1")
            for i, (got, dim) in enumerate(zip(shape, spec.shape, strict=True)):
                if i > 0 and isinstance(dim, int) and dim > 0 and got != dim:
                    raise BadRequest(f"input {name!r} has shape {shape}; the model expects {_dims(spec.shape)}")
            arr = tensor.data
            # min/max propagate NaN and show ±inf: two reductions instead of a full boolean temporary.
            if arr.dtype.kind == "f" and arr.size and not (np.isfinite(arr.min()) and np.isfinite(arr.max())):
                raise BadRequest(f"input {name!r} contains NaN or infinity")
            inputs[name] = arr
        missing = sorted(set(expected) - set(inputs))
        if missing:
            raise BadRequest(f"missing input(s) {missing}")
        if len({a.shape[0] for a in inputs.values()}) != 1:
            raise BadRequest(f"inputs disagree on the batch size: {sorted({a.shape[0] for a in inputs.values()})}")
        self.check_samples(next(iter(inputs.values())).shape[0])
        return inputs, served.keys() != {t.name for t in m.spec.inputs}

    def check_samples(self, samples: int, what: str = "samples") -> None:
        """413 for more samples than one request may carry: ``max_request_samples``, and never more than the queue
        holds (``max_queue``): such a request would be refused forever, so it is too large, not a case of overload."""
        s = self.settings
        if samples > s.max_request_samples:
            raise BadRequest(f"{samples} {what} in one request; this server takes at most {s.max_request_samples} "
                             "(SERVOPT_MAX_REQUEST_SAMPLES)", Reason.TOO_LARGE)
        if samples > s.max_queue:
            raise BadRequest(f"{samples} {what} in one request; the queue holds at most {s.max_queue} "
                             "(send fewer per request, or raise --max-queue)", Reason.TOO_LARGE)

    async def _run(self, name: str, inputs: dict[str, np.ndarray], arrival: Arrival | None) -> np.ndarray:
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):  # no extra task per request, as wait_for makes
                return await self.batchers[name].submit(inputs, arrival)
        except (Overloaded, ShuttingDown) as e:
            raise _refusal(e) from e
        except TooLarge as e:
            raise BadRequest(str(e), Reason.TOO_LARGE) from e
        except TimeoutError as e:
            raise BadRequest(f"the request took longer than {self.settings.request_timeout_s} s", Reason.TIMEOUT) from e

    async def prepare(self, m: ServedModel, inputs: dict[str, np.ndarray], params: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
        """The family turns served inputs into the model's (a text encoder tokenizes): CPU work, off the event loop
        unless the request is small enough (``_small``) that the hand-off would cost more than the work."""
        try:
            if _small(inputs):
                feed, found = m.family.model_inputs(m.spec, inputs, params)
            else:
                feed, found = await asyncio.get_running_loop().run_in_executor(None, m.family.model_inputs, m.spec, inputs, params)
        except UserError as e:
            raise BadRequest(client_message(e)) from e
        if found.get("truncated"):
            self.metrics.truncated.inc(found["truncated"])
        return feed, found

    async def infer(self, name: str, request: InferRequest, arrival: Arrival | None = None) -> InferResponse:
        m = self.model(name)
        self.require_ready()
        inputs, prepared = self.validate(m, request)
        if request.requested_outputs and any(o != m.output_name for o in request.requested_outputs):
            raise BadRequest(f"unknown output(s) {request.requested_outputs}; the model gives {[m.output_name]}")
        found: dict = {}
        if prepared:
            inputs, found = await self.prepare(m, inputs, request.parameters)
        out = await self._run(name, inputs, arrival)
        return InferResponse(model_name=name, id=request.id, outputs={m.output_name: out}, parameters=found)

    async def embed(self, name: str, texts: list[str] | list[list[int]], truncate: bool = True) -> tuple[np.ndarray, dict]:
        """Sentence embeddings (OpenAI's /v1/embeddings and the family's /embed), batched like any request, of
        ``texts``: strings, or token-id arrays taken as the model's own ids (right-padded, masked, and checked by the
        family as raw ``input_ids`` are). Refuses models that do not take text."""
        m = self.model(name)
        self.require_ready()
        if self.served_inputs(m) == m.spec.inputs or m.spec.task != "embedding":
            raise BadRequest(f"model {name!r} is not a text encoder")
        self.check_samples(len(texts), "texts")
        if all(isinstance(t, str) for t in texts):
            arr = np.empty(len(texts), dtype=object)
            arr[:] = texts
            inputs: dict[str, np.ndarray] = {"text": arr}
        else:
            width = max(len(t) for t in texts)
            ids, mask = np.zeros((len(texts), width), np.int64), np.zeros((len(texts), width), np.int64)
            for row, t in enumerate(texts):  # padding's value does not matter: the mask hides it
                ids[row, :len(t)], mask[row, :len(t)] = t, 1
            inputs = {"input_ids": ids, "attention_mask": mask}
        with self.arrival(name) as arrival:
            feed, found = await self.prepare(m, inputs, {"truncate": truncate})
            return await self._run(name, feed, arrival), found

    # the family's convenience endpoint --------------------------------------------------------------------------
    def convenience_route(self, name: str, route: str) -> ServedModel:
        m = self.model(name)
        if m.family.convenience_route != route:
            raise BadRequest(f"model {name!r} ({m.family.name}) has no /{route} endpoint"
                             + (f"; it has /{m.family.convenience_route}" if m.family.convenience_route else ""))
        return m

    def check_media_type(self, m: ServedModel, content_type: str) -> None:
        if content_type.split(";")[0].strip() not in m.family.convenience_media_types:
            raise BadRequest(f"content type {content_type!r} is not {m.family.convenience_accepts}", Reason.UNSUPPORTED_MEDIA)

    async def convenience(self, name: str, route: str, body: bytes, params: dict[str, str],
                          arrival: Arrival | None = None) -> dict[str, Any]:
        """The family's endpoint: decode (off the event loop: CPU work), batch with everything else, answer."""
        m = self.convenience_route(name, route)
        payload = decode_json(body) if m.family.convenience_body == "json" else body
        try:
            parsed = m.family.convenience_params(params)
            inputs = await asyncio.get_running_loop().run_in_executor(
                None, lambda: m.family.convenience_inputs(m.spec, payload, self.settings.max_image_pixels))
        except UserError as e:
            raise BadRequest(client_message(e)) from e
        out = await self._run(name, inputs, arrival)
        return {"model_name": name, **m.family.convenience_output(m.spec, out, parsed)}


# Preparing a request this small on the event loop is cheaper than handing it to a worker thread and back: tokenizing
# a one-sentence request took 35-80 µs of CPU, the two thread switches of the hand-off 30-170 µs (more when the server
# is idle enough for the worker to sleep), on an AVX2 EPYC. A tokenizer spends about 0.6 µs per character there, so the
# bound keeps the loop blocked for at most a few hundred µs; a larger request goes to a worker as before.
INLINE_TEXTS, INLINE_CHARS, INLINE_TOKENS = 4, 512, 4096


# An absolute path's folders ("/srv/models/x/" of "/srv/models/x/config.json"): not after a word, ":" or "/", so
# "0/1", "and/or" and URLs ("https://…") are left alone.
_SERVER_FOLDERS = re.compile(r"(?<![\w:/.~-])/(?:[^\s'\"(),;:/]+/)+")


def client_message(e: UserError) -> str:
    """A ``UserError`` as a client reads it: problem and fix, every absolute path cut to its file name. A family or
    a model loader writes its messages for the operator, who may be shown where a file is; a client must never learn
    the server's layout from a 4xx."""
    return _SERVER_FOLDERS.sub("", e.problem + (f" ({e.fix})" if e.fix else ""))


def _small(inputs: dict[str, np.ndarray]) -> bool:
    """Whether served inputs are cheap enough to prepare on the event loop: at most ``INLINE_TEXTS`` texts of
    ``INLINE_CHARS`` characters (bytes) in all, or raw token inputs of at most ``INLINE_TOKENS`` elements each."""
    text = inputs.get("text")
    if text is None:
        return all(a.size <= INLINE_TOKENS for a in inputs.values())
    if text.size > INLINE_TEXTS:
        return False
    chars = 0
    for item in text.reshape(-1):
        if not isinstance(item, str | bytes):
            return False
        chars += len(item)
    return chars <= INLINE_CHARS


def _refusal(e: Overloaded | ShuttingDown) -> BadRequest:
    """The batcher's refusal as the client's answer: overload says when to retry; shutting down is unavailability."""
    if isinstance(e, ShuttingDown):
        return BadRequest(f"{e}; retry on another replica", Reason.UNAVAILABLE, retry_after=1)
    return BadRequest(f"overloaded: {e}; retry later", Reason.OVERLOADED, retry_after=e.retry_after)
