"""The REST front end: Open Inference Protocol v2 (KServe/Triton) plus the family's convenience endpoint, on FastAPI.

Transport only: bodies are read here (with the size limit), decoded by
``protocol`` into typed requests, handed to the ``DataPlane``, and its answers
encoded back. Inference runs in worker threads behind the dynamic batcher,
never on the event loop. Every error is a JSON ``{"error": "..."}`` with a
4xx/5xx code that says what went wrong; bad input never gets a 500 and never
stops the server.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from servopt import __version__
from servopt.serve.dataplane import DataPlane
from servopt.serve.metrics import Metrics
from servopt.serve.model import ServedModel
from servopt.serve.protocol import HEADER, BadRequest, Reason, decode_json, decode_rest_request, encode_rest_response
from servopt.settings import ServeSettings

HEADER_BYTES = HEADER.encode()  # ASGI header names arrive lowercased


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _known_endpoints() -> set[str]:
    from servopt.families import FAMILIES

    FAMILIES.load()
    routes = {cls.convenience_route for cls in FAMILIES.classes.values() if cls.convenience_route}
    return {"v2", "v2/health/live", "v2/health/ready", "v2/models/{name}", "v2/models/{name}/ready", "v2/models/{name}/config",
            "v2/models/{name}/infer", "v1/embeddings", "metrics", "docs", "openapi.json", *(f"v2/models/{{name}}/{r}" for r in routes)}


KNOWN_ENDPOINTS = _known_endpoints()


def _endpoint(path: str) -> str:
    """The route template of a path, for metric labels. Anything else is "other": a label copied from the raw path
    would let any client create unbounded label values (memory) and inject characters into the exposition."""
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[:2] == ["v2", "models"]:
        parts = ["v2", "models", "{name}", *parts[3:]]
    template = "/".join(parts)
    return template if template in KNOWN_ENDPOINTS else "other"


def _model_of(path: str) -> str | None:
    """The model a ``/v2/models/{name}/…`` POST is for (None for other routes)."""
    parts = path.strip("/").split("/")
    return parts[2] if len(parts) >= 4 and parts[:2] == ["v2", "models"] else None


async def _drain(receive, limit: int) -> bool:
    """Consume and discard a request body (cheap next to parsing it), so the connection stays usable; at most
    ``limit`` bytes. False when the body runs past it (a chunked body declares no size): the rest is left unread and
    the connection must close."""
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return True
        seen += len(message.get("body", b""))
        if seen > limit:
            return False
        if not message.get("more_body", False):
            return True


class GuardMiddleware:
    """Auth, size limit (declared, and counted as a chunked body arrives), readiness, overload and per-request
    metrics, as plain ASGI.

    Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) wraps every request in extra tasks and
    streams; at hundreds of requests per second on 2 cores that overhead is measurable, so this is written
    against ASGI directly.
    """

    def __init__(self, app, *, plane: DataPlane, max_body: int) -> None:
        self.app, self.plane, self.max_body = app, plane, max_body

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

        headers = dict(scope["headers"])
        refusal = self._refusal(scope, path, headers)
        if refusal is None and headers.get(b"content-length") is None:
            receive = self._capped(receive)  # chunked: no declared size to refuse up front, so count as it arrives
        try:
            if refusal is not None:
                # Read the body first (a client still writing it would block on a full socket), but no more than
                # --max-body-mb: past it (a chunked body, refused at its headers for a bad token or overload) the
                # refusal closes the connection instead of reading an unbounded upload.
                if refusal.status_code != 413 and not await _drain(receive, self.max_body):
                    refusal.headers["Connection"] = "close"
                await refusal(scope, receive, send_and_record)
            else:
                await self.app(scope, receive, send_and_record)
        except BadRequest as e:  # raised outside a route's handlers (e.g. the body cap inside a parser)
            if status["code"] == 500:
                await _error(e.status, str(e), e.headers)(scope, receive, send_and_record)
        except Exception as e:  # noqa: BLE001 - the last line of defence: a JSON error, the server stays up
            if status["code"] == 500:
                await _error(500, f"internal error: {type(e).__name__}")(scope, receive, send_and_record)
        finally:
            self.plane.metrics.observe_request(_endpoint(path), status["code"], time.perf_counter() - start)

    def _refusal(self, scope, path: str, headers: dict[bytes, bytes]) -> JSONResponse | None:
        if not path.startswith("/v2/health") and not self.plane.authorized(headers.get(b"authorization")):
            return _error(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return _error(400, "Content-Length is not a number")
            if int(length) > self.max_body:  # not drained: close the connection instead of reading gigabytes
                return _error(413, f"request body of {int(length)} bytes is over the {self.max_body}-byte limit",
                              {"Connection": "close"})
        if scope["method"] == "POST":
            # Refuse before parsing the body: under overload, parsing megabytes only to refuse them is what makes
            # refusals slow. (The batcher still decides exactly, with the request's real size, when it is submitted.)
            try:
                self.plane.require_ready()
                if (model := _model_of(path)) is not None:
                    self.plane.admit(model)
            except BadRequest as e:
                return _error(e.status, str(e), e.headers)
        return None

    def _capped(self, receive):
        """``receive`` that refuses (413, connection closed) a body growing past the limit: a chunked upload declares
        no Content-Length, and a multipart parser would otherwise spool any size of file part to disk."""
        seen = 0

        async def capped():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BadRequest(f"request body is over the {self.max_body}-byte limit (--max-body-mb)", Reason.TOO_LARGE,
                                     close=True)
            return message

        return capped


def _token_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and -(2**63) <= x < 2**63


def embedding_input(value: object) -> list[str] | list[list[int]]:
    """OpenAI's ``input``: a string, a list of strings, one token array (a list of integers) or a list of token
    arrays. Token ids are the served model's own (checked against its vocabulary by its family), not OpenAI's."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(t, str) for t in value):
            return value
        if all(_token_id(t) for t in value):
            return [value]
        if all(isinstance(t, list) and t and all(_token_id(x) for x in t) for t in value):
            return value
    raise BadRequest("'input' must be a string, a non-empty list of strings, a token array (a non-empty list of "
                     "integers: the model's own token ids) or a list of token arrays")


async def _read_body(receive) -> bytes:
    """The whole body from ASGI ``receive``, as Starlette's ``Request.body`` reads it (a disconnect raises
    ``ClientDisconnect``); the size limit is ``GuardMiddleware``'s, declared or counted."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()


def _hot_model(path: str) -> str | None:
    """The model of a ``POST /v2/models/{name}/infer`` path (what FastAPI's route matches), else None."""
    parts = path.split("/")
    if len(parts) == 5 and parts[0] == "" and parts[1] == "v2" and parts[2] == "models" and parts[3] and parts[4] == "infer":
        return parts[3]
    return None


class ServingApp(FastAPI):
    """FastAPI, with the two inference routes answered ahead of its own stack.

    A request through FastAPI's middleware, router and request handling cost about 115 µs of CPU in that machinery
    alone (an empty route, measured in-process on an AVX2 EPYC), a sizeable share of a one-sentence embedding
    request's non-model CPU. ``POST /v1/embeddings`` and ``POST /v2/models/{name}/infer`` therefore go from here to
    ``hot``, the same handler functions the FastAPI routes call, wrapped in the app's own middleware
    (``GuardMiddleware``: auth, size limits, readiness, admission, metrics, the last-resort JSON 500; and whatever was
    added after ``create_app``, as Ray Serve's replica header), built a second time at the first such request, as
    Starlette builds its stack. The FastAPI routes stay declared for the OpenAPI schema and answer everything else
    (other methods, a ``root_path``). FastAPI's own OpenTelemetry hooks do not see these two routes."""

    _hot: Callable | None = None
    _hot_stack: Callable | None = None

    @property
    def hot(self) -> Callable | None:
        """The inference routes' ASGI handler, without middleware (None: everything through FastAPI)."""
        return self._hot

    @hot.setter
    def hot(self, handler: Callable | None) -> None:
        self._hot, self._hot_stack = handler, None

    async def __call__(self, scope, receive, send) -> None:
        if (self._hot is not None and scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path")
                and (scope["path"] == "/v1/embeddings" or _hot_model(scope["path"]) is not None)):
            if self._hot_stack is None:
                stack = self._hot
                for cls, args, kwargs in reversed(self.user_middleware):  # the first listed is the outermost
                    stack = cls(stack, *args, **kwargs)
                self._hot_stack = stack
            await self._hot_stack(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def openai_embeddings_body(embeddings: np.ndarray, fmt: str, name: str, tokens: int) -> bytes:
    """OpenAI's embeddings answer, encoded by orjson: base64 of each row's little-endian float32 buffer as it lies (no
    copy through ``tobytes``), or the floats themselves (orjson reads the NumPy row; ``tolist`` then the stdlib encoder,
    let alone FastAPI's ``jsonable_encoder``, cost ~600 µs for 384 floats)."""
    vectors = np.ascontiguousarray(embeddings, dtype="<f4")
    data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(v).decode("ascii") if fmt == "base64" else v}
            for i, v in enumerate(vectors)]
    doc = {"object": "list", "data": data, "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


class Frontend(Protocol):
    """Another front end on the same data plane (gRPC), started and stopped with the REST app."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def create_app(models: dict[str, ServedModel] | DataPlane, settings: ServeSettings | None = None,
               frontends: list[Frontend] | None = None, exposition: Callable[[], Awaitable[bytes]] | None = None) -> FastAPI:
    """The REST app over a data plane (made here from ``models``, or shared with other front ends).

    ``exposition`` replaces what ``GET /metrics`` answers (the plane's own registry by default): under Ray Serve,
    the sum over every replica (``ray_serve``). The route, its auth and its request metrics stay the same."""
    plane = models if isinstance(models, DataPlane) else DataPlane(models, settings or ServeSettings())
    max_body = int(plane.settings.max_body_mb * 1024 * 1024)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if not plane.ready:
            await plane.start()
        for f in frontends or []:
            await f.start()
        yield
        for f in frontends or []:  # stop taking new work everywhere, then finish what is queued
            await f.stop()
        await plane.stop()

    app = ServingApp(title="servopt inference server", version=__version__, lifespan=lifespan,
                     description="Open Inference Protocol v2 (KServe / Triton) with dynamic batching")
    app.add_middleware(GuardMiddleware, plane=plane, max_body=max_body)

    async def read_body(request: Request) -> bytes:
        return await request.body()  # the size limit is GuardMiddleware's, declared or chunked

    async def infer_answer(name: str, body: Callable[[], Awaitable[bytes]], header_length: str | None) -> Response:
        with plane.arrival(name) as arrival:
            req = decode_rest_request(await body(), header_length)
            response = await plane.infer(name, req, arrival)
        content, headers = encode_rest_response(response, req.binary_outputs)
        media = "application/octet-stream" if req.binary_outputs else "application/json"
        return Response(content, media_type=media, headers=headers)

    async def embeddings_answer(body: bytes) -> Response:
        try:
            doc = decode_json(body)
            if not isinstance(doc, dict):
                raise BadRequest("the body must be a JSON object with 'model' and 'input'")
            texts = embedding_input(doc.get("input"))
            fmt = doc.get("encoding_format", "float")
            if fmt not in ("float", "base64"):
                raise BadRequest(f"encoding_format {fmt!r} must be 'float' or 'base64'")
            name = doc.get("model")
            if not isinstance(name, str) or name not in plane.models:
                texts_models = [n for n, m in plane.models.items() if m.spec.task == "embedding"]
                raise BadRequest(f"unknown model {name!r}; this server embeds with {texts_models}", Reason.NOT_FOUND)
            dims = doc.get("dimensions")
            embeddings, found = await plane.embed(name, texts)
        except BadRequest as e:  # OpenAI's error shape, so its clients raise their usual exceptions
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "param": None, "code": e.status}},
                                status_code=e.status, headers=e.headers)
        if isinstance(dims, int) and 0 < dims < embeddings.shape[1]:  # Matryoshka-style truncation, renormalized
            embeddings = embeddings[:, :dims] / (np.linalg.norm(embeddings[:, :dims], axis=1, keepdims=True) + 1e-12)
        return Response(openai_embeddings_body(embeddings, fmt, name, found.get("tokens", 0)), media_type="application/json")

    async def hot(scope, receive, send) -> None:
        """The inference routes without FastAPI's routing (``ServingApp``): same handlers, same error answers."""
        path = scope["path"]
        try:
            if path == "/v1/embeddings":
                response = await embeddings_answer(await _read_body(receive))
            else:
                header = next((v.decode("latin-1") for k, v in scope["headers"] if k == HEADER_BYTES), None)
                response = await infer_answer(_hot_model(path) or "", lambda: _read_body(receive), header)
        except BadRequest as e:
            response = _error(e.status, str(e), e.headers)
        await response(scope, receive, send)

    app.hot = hot

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

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        if not plane.ready:
            return _error(503, "not ready")
        return {"ready": True}

    @app.get("/v2")
    async def server_metadata():
        return plane.server_metadata().model_dump()

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str):
        return plane.model_metadata(name).model_dump()

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str):
        return {"name": name, "ready": plane.model_ready(name)}

    @app.get("/v2/models/{name}/config")
    async def model_config(name: str):
        return plane.model_config(name)

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request):
        return await infer_answer(name, request.body, request.headers.get(HEADER))

    @app.post("/v2/models/{name}/{route}")
    async def convenience(name: str, route: str, request: Request):
        """The model family's endpoint: for image classifiers ``classify`` takes JPEG/PNG bytes (raw body or a
        multipart ``file``) and answers the top-k labels."""
        m = plane.convenience_route(name, route)
        with plane.arrival(name) as arrival:  # on its way from the first byte: decoding is the long part
            ctype = request.headers.get("content-type", "")
            if ctype.startswith("multipart/form-data"):
                try:
                    form = await request.form(max_part_size=max_body)
                except BadRequest:
                    raise  # over the size limit
                except Exception as e:
                    raise BadRequest(f"malformed multipart body: {e}") from e
                upload = form.get("file")
                if upload is None or isinstance(upload, str):
                    raise BadRequest("multipart body needs a 'file' part")
                body = await upload.read()
            else:
                plane.check_media_type(m, ctype)
                body = await read_body(request)
            return await plane.convenience(name, route, body, dict(request.query_params), arrival)

    @app.post("/v1/embeddings")
    async def openai_embeddings(request: Request):
        """OpenAI's embeddings API (what LangChain, LlamaIndex and the ``openai`` client speak), on a text encoder:
        ``{"model", "input": str | [str] | [int] | [[int]], "encoding_format": "float" | "base64"}``; token arrays
        are the model's own token ids."""
        return await embeddings_answer(await read_body(request))

    @app.get("/metrics")
    async def prometheus():
        text = await exposition() if exposition else generate_latest(plane.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    app.state.plane = plane
    return app


__all__ = ["Metrics", "ServeSettings", "create_app"]
