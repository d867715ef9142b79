"""The gRPC front end: the Open Inference Protocol v2 ``inference.GRPCInferenceService`` (KServe / Triton) on ``grpc.aio``.

Transport only, as ``rest`` is for HTTP: a servicer decodes each protobuf message into the data plane's typed
request, calls the ``DataPlane`` (the same one, batcher and metrics as REST, in the same event loop) and encodes its
answer. Checking tensors, batching, readiness, auth and metadata live in the data plane.

- ``ModelInfer`` reads ``raw_input_contents`` (one per input, in order: what tritonclient.grpc sends) or else each
  input's typed ``contents``; BYTES in either as Triton's length-prefixed elements. Outputs go back as
  ``raw_output_contents``.
- Every problem with a request is a ``BadRequest`` whose ``Reason`` maps to a status code (``GRPC_CODE``): over the
  latency budget or the queue ``RESOURCE_EXHAUSTED`` with trailing metadata ``retry-after``, too large
  ``RESOURCE_EXHAUSTED`` without it, not ready ``UNAVAILABLE``; a request that is not
  even a valid protobuf message is ``INVALID_ARGUMENT`` too (the handlers parse leniently: gRPC's own parser would
  answer ``INTERNAL``). ``INTERNAL`` is left for bugs, like REST's 500.
- With an API key, every RPC but ServerLive/ServerReady needs metadata ``authorization: Bearer KEY``.
- Messages are limited to ``max_body_mb`` both ways (gRPC answers ``RESOURCE_EXHAUSTED`` past it), concurrent RPCs
  to ``limit_concurrency`` when set.
- Every RPC that reaches a handler is counted in ``servopt_requests_total{endpoint="grpc/<Method>", code="<CODE>"}``;
  the method names are the service's own, so the label set is bounded.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np

from servopt.errors import UserError
from servopt.serve.dataplane import DataPlane
from servopt.serve.proto import grpc_service_pb2 as pb
from servopt.serve.proto import grpc_service_pb2_grpc as pb_grpc
from servopt.serve.protocol import (
    DATATYPES,
    BadRequest,
    InferRequest,
    InferResponse,
    InputTensor,
    Reason,
    decode_raw_tensor,
    encode_raw_tensor,
    tensor_datatype,
)

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})  # health: never behind the token, as REST's /v2/health
MODEL_VERSION = "1"  # one version per model, as the REST front end and the metadata say
Code = grpc.StatusCode

GRPC_CODE = {
    Reason.INVALID: Code.INVALID_ARGUMENT, Reason.UNAUTHENTICATED: Code.UNAUTHENTICATED, Reason.NOT_FOUND: Code.NOT_FOUND,
    # gRPC's own answer to a message over the size limit, so a client sees one code for "too large" whether gRPC or
    # servopt noticed it; the message says which limit, and no retry-after comes with it.
    Reason.TOO_LARGE: Code.RESOURCE_EXHAUSTED, Reason.UNSUPPORTED_MEDIA: Code.INVALID_ARGUMENT,
    # Overload is the client's cue to back off (retry-after says how long): RESOURCE_EXHAUSTED, which gRPC clients do
    # not retry at once as they do UNAVAILABLE; not ready is the server's state.
    Reason.OVERLOADED: Code.RESOURCE_EXHAUSTED, Reason.UNAVAILABLE: Code.UNAVAILABLE, Reason.TIMEOUT: Code.DEADLINE_EXCEEDED,
}


def status_code(error: BadRequest) -> grpc.StatusCode:
    """The gRPC code of a data plane error, from its reason."""
    return GRPC_CODE[error.reason]


# --- protobuf → the data plane's types -------------------------------------------------------------------------------

# The typed field of each datatype; FP16 (and BF16, which servopt does not serve) travel only as raw contents.
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                  "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
                  "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
_WIRE_DTYPE = {"int_contents": np.int32, "int64_contents": np.int64, "uint_contents": np.uint32, "uint64_contents": np.uint64,
               "fp32_contents": np.float32, "fp64_contents": np.float64, "bool_contents": np.bool_}


def _from_contents(contents: pb.InferTensorContents, datatype: str, name: str) -> np.ndarray:
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise BadRequest(f"input {name!r}: {datatype} has no typed contents field; send it in raw_input_contents")
    given = [f.name for f, _ in contents.ListFields()]
    if given and field not in given:
        raise BadRequest(f"input {name!r} is {datatype}, which goes in contents.{field}; the request filled {given}")
    values = getattr(contents, field)
    if field == "bytes_contents":
        arr = np.empty(len(values), dtype=object)
        arr[:] = list(values)
        return arr
    arr = np.fromiter(values, dtype=_WIRE_DTYPE[field], count=len(values))
    dtype = DATATYPES[datatype]
    if arr.dtype != dtype:  # INT8/INT16, UINT8/UINT16 arrive widened to 32 bits: refuse what does not fit
        info = np.iinfo(dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise BadRequest(f"input {name!r}: contents.{field} holds values outside {datatype}'s range [{info.min}, {info.max}]")
        arr = arr.astype(dtype)
    return arr


def _parameter(p: pb.InferParameter) -> Any:
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


def decode_infer_request(request: pb.ModelInferRequest) -> InferRequest:
    """A ``ModelInferRequest`` → ``InferRequest``: the envelope only (names, datatypes and shapes against the model
    are the data plane's check). Every malformed field is a ``BadRequest`` naming it."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one per input, in order")
    inputs: list[InputTensor] = []
    for i, tensor in enumerate(request.inputs):
        name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
        if not name:
            raise BadRequest(f"inputs[{i}] has no name")
        if datatype not in DATATYPES:
            raise BadRequest(f"input {name!r}: datatype {datatype!r} is not supported ({', '.join(DATATYPES)})")
        if any(d < 0 for d in shape):
            raise BadRequest(f"input {name!r}: shape {shape} has a negative dimension")
        count = math.prod(shape)
        if raw:
            if tensor.HasField("contents"):
                raise BadRequest(f"input {name!r} has contents and raw_input_contents: send one or the other")
            chunk = raw[i]
            arr = decode_raw_tensor(chunk, datatype, shape, name, f"raw_input_contents[{i}] of {len(chunk)} bytes")
        elif tensor.HasField("contents"):
            arr = _from_contents(tensor.contents, datatype, name)
        else:
            raise BadRequest(f"input {name!r} has no data: set its contents or send raw_input_contents")
        if arr.size != count:
            raise BadRequest(f"input {name!r}: {arr.size} elements given, shape {shape} needs {count}")
        inputs.append(InputTensor(name=name, datatype=datatype, shape=shape, data=arr.reshape(shape)))
    return InferRequest(id=request.id or None, inputs=inputs, requested_outputs=[o.name for o in request.outputs] or None,
                        parameters={k: _parameter(v) for k, v in request.parameters.items()})


def encode_infer_response(response: InferResponse) -> pb.ModelInferResponse:
    out = pb.ModelInferResponse(model_name=response.model_name, model_version=MODEL_VERSION, id=response.id or "")
    for name, arr in response.outputs.items():
        arr = np.asarray(arr)
        out.outputs.add(name=name, datatype=tensor_datatype(arr), shape=arr.shape)
        out.raw_output_contents.append(encode_raw_tensor(arr))
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


# --- the servicer ------------------------------------------------------------------------------------------------------

class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The service's methods over a data plane; errors are raised as ``BadRequest`` and mapped by ``service_handler``."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def _model(self, name: str, version: str) -> None:
        self.plane.model(name)
        if version not in ("", MODEL_VERSION):
            raise BadRequest(f"model {name!r} has no version {version!r}; it has [{MODEL_VERSION!r}]", Reason.NOT_FOUND)

    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.plane.ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext) -> pb.ModelReadyResponse:
        self._model(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.plane.model_ready(request.name))

    async def ServerMetadata(self, request: pb.ServerMetadataRequest,
                             context: grpc.aio.ServicerContext) -> pb.ServerMetadataResponse:
        m = self.plane.server_metadata()
        return pb.ServerMetadataResponse(name=m.name, version=m.version, extensions=m.extensions)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest,
                            context: grpc.aio.ServicerContext) -> pb.ModelMetadataResponse:
        self._model(request.name, request.version)
        m = self.plane.model_metadata(request.name)
        tensors = [[pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape) for t in ts]
                   for ts in (m.inputs, m.outputs)]
        return pb.ModelMetadataResponse(name=m.name, versions=m.versions, platform=m.platform, inputs=tensors[0],
                                        outputs=tensors[1], properties={k: _text(v) for k, v in m.parameters.items()})

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext) -> pb.ModelConfigResponse:
        self._model(request.name, request.version)
        c = self.plane.model_config(request.name)

        def data_type(name: str) -> int:  # Triton calls BYTES "STRING" in model configurations
            return pb.DataType.Value("TYPE_STRING" if name == "TYPE_BYTES" else name)

        config = pb.ModelConfig(
            name=c["name"], platform=c["platform"], max_batch_size=c["max_batch_size"],
            input=[pb.ModelInput(name=t["name"], data_type=data_type(t["data_type"]), dims=t["dims"]) for t in c["input"]],
            output=[pb.ModelOutput(name=t["name"], data_type=data_type(t["data_type"]), dims=t["dims"]) for t in c["output"]],
            instance_group=[pb.ModelInstanceGroup(count=g["count"], kind=pb.ModelInstanceGroup.Kind.Value(g["kind"]))
                            for g in c["instance_group"]],
            parameters={k: pb.ModelParameter(string_value=v["string_value"]) for k, v in c["parameters"].items()})
        if c["dynamic_batching"]:
            config.dynamic_batching.max_queue_delay_microseconds = c["dynamic_batching"]["max_queue_delay_microseconds"]
        return pb.ModelConfigResponse(config=config)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        name = request.model_name
        self._model(name, request.model_version)
        self.plane.require_ready()
        self.plane.admit(name)  # refuse overload before decoding the tensors
        with self.plane.arrival(name) as arrival:
            response = await self.plane.infer(name, decode_infer_request(request), arrival)
        return encode_infer_response(response)


class _Undecodable:
    """What a handler receives instead of a message when the bytes do not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = f"{type(error).__name__}: {str(error)[:200]}"


def _lenient(message: type) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except Exception as e:  # noqa: BLE001 - whatever the parser objects to is the client's problem: INVALID_ARGUMENT
            return _Undecodable(e)

    return parse


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None


def _handler(plane: DataPlane, method: str, behaviour: Callable[[Any, Any], Awaitable[Any]], request_type: type,
             response_type: type) -> grpc.RpcMethodHandler:
    endpoint, needs_token = f"grpc/{method}", method not in OPEN_METHODS

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        start = time.perf_counter()
        code = Code.OK
        try:
            if needs_token and not plane.authorized(_metadata(context, "authorization")):
                raise BadRequest("missing or wrong bearer token (metadata 'authorization: Bearer KEY')", Reason.UNAUTHENTICATED)
            if isinstance(request, _Undecodable):
                raise BadRequest(f"the request is not a valid {request_type.__name__}: {request.error}")
            return await behaviour(request, context)
        except BadRequest as e:
            code, details = status_code(e), str(e)
            retry = (e.headers or {}).get("Retry-After")
            trailers = (("retry-after", retry),) if retry else ()
        except asyncio.CancelledError:  # the client went away or its deadline passed
            code = Code.CANCELLED
            raise
        except Exception as e:  # noqa: BLE001 - the last line of defence: a status, the server stays up
            code, details, trailers = Code.INTERNAL, f"internal error: {type(e).__name__}", ()
        finally:
            plane.metrics.observe_request(endpoint, code.name, time.perf_counter() - start)
        await context.abort(code, details, trailers)

    return grpc.unary_unary_rpc_method_handler(call, request_deserializer=_lenient(request_type),
                                               response_serializer=response_type.SerializeToString)


def service_handler(plane: DataPlane) -> grpc.GenericRpcHandler:
    """Every method of ``inference.GRPCInferenceService``, served by ``InferenceServicer`` over ``plane``."""
    servicer = InferenceServicer(plane)
    handlers = {m.name: _handler(plane, m.name, getattr(servicer, m.name), getattr(pb, m.input_type.name),
                                 getattr(pb, m.output_type.name)) for m in SERVICE.methods}
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


class GrpcFrontend:
    """The gRPC server, started and stopped with the REST app (``create_app(plane, frontends=[GrpcFrontend(...)])``)
    in the same event loop. ``port=0`` picks a free port; ``self.port`` is the bound one after ``start``."""

    def __init__(self, plane: DataPlane, host: str, port: int) -> None:
        self.plane, self.host, self.port = plane, host, port
        self.server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def start(self) -> None:
        s = self.plane.settings
        limit = min(int(s.max_body_mb * 1024 * 1024), 2**31 - 1)
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                     ("grpc.so_reuseport", 0)],  # a port in use is an error, not a second listener on it
            maximum_concurrent_rpcs=s.limit_concurrency)
        server.add_generic_rpc_handlers((service_handler(self.plane),))
        try:
            bound = server.add_insecure_port(self.address)
        except RuntimeError as e:
            bound, reason = 0, str(e)
        else:
            reason = "the address is in use or not available"
        if not bound:
            raise UserError(f"cannot serve gRPC on {self.address}: {reason}", fix="choose another --grpc-port or --host")
        self.port = bound
        await server.start()
        self.server = server

    async def stop(self, grace: float | None = None) -> None:
        """Graceful: refuse new RPCs at once, let those in flight finish (up to the request timeout + 5 s)."""
        if self.server is None:
            return
        server, self.server = self.server, None
        await server.stop(grace if grace is not None else self.plane.settings.request_timeout_s + 5)
