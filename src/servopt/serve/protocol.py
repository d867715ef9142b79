"""Open Inference Protocol v2 (KServe / Triton): the wire types, and the REST codec (JSON and binary tensors).

Triton's binary-tensor extension: the body starts with a JSON header of
``Inference-Header-Content-Length`` bytes; tensors whose ``parameters`` carry
``binary_data_size`` follow as raw little-endian bytes, in order (a BYTES
tensor as 4-byte little-endian lengths, each followed by its bytes).
tritonclient sends inputs that way by default (``binary_data=True``) and asks
for binary outputs, so a server must speak it to work with the stock client.

No library implements the server side of this codec for FastAPI (Triton and
KServe embed their own), so it is written here. This module only decodes the
envelope: checking tensors against a model is the data plane's job, shared by
every front end. Every malformed body becomes a ``BadRequest``, never a 500.
"""

from __future__ import annotations

import json
import math
import re
import struct
from enum import StrEnum
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel, Field

DATATYPES = {
    "BOOL": np.dtype(bool), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16), "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64), "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
NP_TO_DATATYPE = {v.name: k for k, v in DATATYPES.items() if k != "BYTES"}
HEADER = "inference-header-content-length"


class Reason(StrEnum):
    """Why a request is refused: each front end maps it to its own status (``HTTP_STATUS``, gRPC's codes in
    ``grpc_server``), so no front end reads the message to choose a code."""

    INVALID = "invalid"  # anything wrong with the request itself
    UNAUTHENTICATED = "unauthenticated"  # missing or wrong bearer token
    NOT_FOUND = "not_found"  # unknown model, version or route
    TOO_LARGE = "too_large"  # over a limit the request can never fit (body size, samples, tokens)
    UNSUPPORTED_MEDIA = "unsupported_media"  # a content type the endpoint does not read
    OVERLOADED = "overloaded"  # refused or dropped to keep the wait under the latency budget: back off, retry
    UNAVAILABLE = "unavailable"  # not ready (starting or shutting down)
    TIMEOUT = "timeout"  # took longer than the request timeout


HTTP_STATUS = {Reason.INVALID: 400, Reason.UNAUTHENTICATED: 401, Reason.NOT_FOUND: 404, Reason.TOO_LARGE: 413,
               Reason.UNSUPPORTED_MEDIA: 415, Reason.OVERLOADED: 503, Reason.UNAVAILABLE: 503, Reason.TIMEOUT: 504}


class BadRequest(Exception):
    """A request the server refuses, with the message naming the problem and the fix, and why (``reason``).
    ``retry_after`` (seconds) tells the client when to try again (HTTP ``Retry-After``, gRPC trailing metadata)."""

    def __init__(self, message: str, reason: Reason = Reason.INVALID, retry_after: float | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after
        self.close = close  # the body was not read to its end: the connection cannot be reused

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.reason]

    @property
    def headers(self) -> dict[str, str] | None:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))  # whole seconds, as HTTP says
        if self.close:
            headers["Connection"] = "close"
        return headers or None


def datatype_of(dtype: str) -> str:
    return NP_TO_DATATYPE.get(np.dtype(dtype).name, "BYTES")


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str] = Field(default_factory=lambda: ["1"])
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: dict[str, Any] = Field(default_factory=dict)


class ServerMetadata(BaseModel):
    name: str = "servopt"
    version: str
    extensions: list[str]


class InputTensor(BaseModel):
    """One decoded input: a NumPy array with its declared datatype (BYTES: an object array of ``bytes``)."""

    model_config = {"arbitrary_types_allowed": True}

    name: str
    datatype: str
    shape: list[int]
    data: Any  # np.ndarray


class InferRequest(BaseModel):
    model_config = {"arbitrary_types_allowed": True}

    id: str | None = None
    inputs: list[InputTensor]
    requested_outputs: list[str] | None = None
    binary_outputs: bool = False
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferResponse(BaseModel):
    model_config = {"arbitrary_types_allowed": True}

    model_name: str
    id: str | None = None
    outputs: dict[str, Any]  # name → np.ndarray
    parameters: dict[str, Any] = Field(default_factory=dict)  # e.g. a text model's tokens and truncated texts


_LONG_DIGITS = re.compile(rb"[0-9]{19}")  # an integer literal this long may not fit 64 bits


def decode_json(body: bytes | str) -> Any:
    """The one JSON decoder of the serving path: any failure (bad UTF-8, bad syntax, nesting deep enough to exhaust
    the recursion limit, numbers too large) is a 400 naming the problem.

    orjson reads strict JSON several times faster (a JSON tensor of an image: milliseconds instead of tens). Whatever
    it refuses (NaN, lone surrogates, deep nesting, other encodings) is read again by the standard library, and so is
    a body with 19 digits in a row, where an integer past 64 bits may be (orjson would read it as a float; the standard
    library's int is refused where it does not fit): every body decodes, or fails, exactly as it always has."""
    if isinstance(body, bytes) and not _LONG_DIGITS.search(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(body)
    except RecursionError as e:
        raise BadRequest("the request body is nested too deeply to decode") from e
    except Exception as e:
        raise BadRequest(f"the request body is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from e


def decode_bytes_tensor(raw: memoryview | bytes, count: int, name: str) -> np.ndarray:
    """Triton's BYTES serialization: each element a 4-byte little-endian length, then that many bytes."""
    out, offset, raw = [], 0, memoryview(raw)
    for _ in range(count):
        if offset + 4 > len(raw):
            raise BadRequest(f"input {name!r}: BYTES data ends inside an element's length prefix")
        (n,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + n > len(raw):
            raise BadRequest(f"input {name!r}: a BYTES element of {n} bytes runs past the data")
        out.append(bytes(raw[offset:offset + n]))
        offset += n
    if offset != len(raw):
        raise BadRequest(f"input {name!r}: {len(raw) - offset} bytes of BYTES data left over")
    arr = np.empty(count, dtype=object)
    arr[:] = out
    return arr


def encode_bytes_tensor(arr: np.ndarray) -> bytes:
    parts = []
    for item in arr.reshape(-1):
        b = item if isinstance(item, bytes) else str(item).encode()
        parts += [struct.pack("<I", len(b)), b]
    return b"".join(parts)


def decode_raw_tensor(raw: memoryview | bytes, datatype: str, shape: list[int], name: str, source: str) -> np.ndarray:
    """One tensor's raw bytes (REST binary data, gRPC ``raw_input_contents``) → a flat array: little-endian elements,
    or Triton's BYTES serialization. ``source`` names the bytes in the error ("binary_data_size 12" …)."""
    count = math.prod(shape)
    if datatype == "BYTES":
        return decode_bytes_tensor(raw, count, name)
    dtype = DATATYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise BadRequest(f"input {name!r}: {source} does not match shape {shape} of {datatype} ({count * dtype.itemsize} bytes)")
    arr = np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
    if arr.dtype != dtype:  # only a big-endian host needs the byte swap; elsewhere the body is used as is
        arr = arr.astype(dtype)
    return arr


def tensor_datatype(arr: np.ndarray) -> str:
    return "BYTES" if arr.dtype == object else datatype_of(arr.dtype.name)


def encode_raw_tensor(arr: np.ndarray) -> bytes:
    """An output's raw bytes (REST binary data, gRPC ``raw_output_contents``): little-endian, or BYTES serialized."""
    arr = np.ascontiguousarray(arr)
    return encode_bytes_tensor(arr) if arr.dtype == object else arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def _json_bytes_data(data: Any, name: str) -> np.ndarray:
    flat = list(_flatten(data))
    if not all(isinstance(x, str) for x in flat):
        raise BadRequest(f"input {name!r}: BYTES data must be strings")
    arr = np.empty(len(flat), dtype=object)
    arr[:] = [x.encode("utf-8", "surrogatepass") for x in flat]
    return arr


def _flatten(data: Any):
    if isinstance(data, list):
        for x in data:
            yield from _flatten(x)
    else:
        yield data


def decode_rest_request(body: bytes, header_length: str | None) -> InferRequest:
    """A v2 REST infer body (plain JSON, or a JSON header followed by binary tensors) → ``InferRequest``."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError as e:
            raise BadRequest(f"Inference-Header-Content-Length {header_length!r} is not an integer") from e
        if n < 0 or n > len(body):
            raise BadRequest(f"Inference-Header-Content-Length {n} is outside the body of {len(body)} bytes")
        header_bytes, binary = body[:n], memoryview(body)[n:]
    else:
        header_bytes, binary = body, memoryview(b"")
    header = decode_json(header_bytes)
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list) or not header["inputs"]:
        raise BadRequest("the request needs an 'inputs' list of tensors")
    inputs: list[InputTensor] = []
    offset = 0
    for i, tensor in enumerate(header["inputs"]):
        if not isinstance(tensor, dict):
            raise BadRequest(f"inputs[{i}] must be an object")
        name, shape, datatype = tensor.get("name"), tensor.get("shape"), tensor.get("datatype")
        if not isinstance(name, str):
            raise BadRequest(f"inputs[{i}] needs a 'name' string")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise BadRequest(f"input {name!r}: 'shape' must be a list of non-negative integers")
        if datatype not in DATATYPES:
            raise BadRequest(f"input {name!r}: datatype {datatype!r} is not supported ({', '.join(DATATYPES)})")
        count = math.prod(shape)
        params = tensor.get("parameters") or {}
        if not isinstance(params, dict):
            raise BadRequest(f"input {name!r}: 'parameters' must be an object")
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise BadRequest(f"input {name!r}: binary_data_size must be a non-negative integer")
            if offset + size > len(binary):
                raise BadRequest(f"input {name!r}: the body holds {len(binary) - offset} bytes of binary data, {size} expected")
            chunk = binary[offset:offset + size]
            offset += size
            arr = decode_raw_tensor(chunk, datatype, shape, name, f"binary_data_size {size}")
        else:
            if "data" not in tensor:
                raise BadRequest(f"input {name!r} has no 'data' (or binary_data_size)")
            if datatype == "BYTES":
                arr = _json_bytes_data(tensor["data"], name)
            else:
                try:
                    arr = np.asarray(tensor["data"], dtype=DATATYPES[datatype]).reshape(-1)
                except (ValueError, TypeError, OverflowError, RecursionError) as e:
                    raise BadRequest(f"input {name!r}: 'data' cannot be read as {datatype}: {str(e)[:200]}") from e
        if arr.size != count:
            raise BadRequest(f"input {name!r}: {arr.size} elements given, shape {shape} needs {count}")
        inputs.append(InputTensor(name=name, datatype=datatype, shape=shape, data=arr.reshape(shape)))
    if offset != len(binary):
        raise BadRequest(f"{len(binary) - offset} bytes of binary data were not claimed by any input")
    outputs = header.get("outputs")
    requested = None
    top_params = header.get("parameters") or {}
    binary_out = bool(top_params.get("binary_data_output", False)) if isinstance(top_params, dict) else False
    if isinstance(outputs, list) and outputs:
        requested = [o.get("name") for o in outputs if isinstance(o, dict)]
        binary_out = any(isinstance(o.get("parameters"), dict) and o["parameters"].get("binary_data", False)
                         for o in outputs if isinstance(o, dict))
    request_id = header.get("id")
    return InferRequest(id=str(request_id) if request_id is not None else None, inputs=inputs, requested_outputs=requested,
                        binary_outputs=binary_out, parameters=top_params if isinstance(top_params, dict) else {})


def _encode_json(body: dict[str, Any]) -> bytes:
    """orjson, reading NumPy arrays without ``tolist`` (the stdlib encoder takes ~10× longer on an embedding); the
    standard library for anything orjson refuses or writes otherwise: NaN and infinity (orjson writes null; the
    answer keeps ``NaN``), lone surrogates in a request id, a dtype it does not read."""
    arrays = [o["data"] for o in body["outputs"] if isinstance(o.get("data"), np.ndarray)]
    if all(a.dtype.kind in "biu" or (a.dtype.kind == "f" and np.isfinite(a).all()) for a in arrays):
        try:
            return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        except orjson.JSONEncodeError:
            pass
    for o in body["outputs"]:
        if isinstance(o.get("data"), np.ndarray):
            o["data"] = o["data"].tolist()
    return json.dumps(body).encode()


def encode_rest_response(response: InferResponse, binary: bool) -> tuple[bytes, dict[str, str]]:
    """(body, extra headers). Binary outputs go after the JSON header, as Triton answers."""
    header_outputs, chunks = [], []
    for name, arr in response.outputs.items():
        arr = np.ascontiguousarray(arr)
        is_bytes = arr.dtype == object
        entry: dict[str, Any] = {"name": name, "shape": list(arr.shape), "datatype": tensor_datatype(arr)}
        if binary:
            raw = encode_raw_tensor(arr)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            flat = arr.reshape(-1)
            entry["data"] = [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in flat] if is_bytes else flat
        header_outputs.append(entry)
    body: dict[str, Any] = {"model_name": response.model_name, "model_version": "1", "outputs": header_outputs}
    if response.parameters:
        body["parameters"] = response.parameters
    if response.id is not None:
        body["id"] = response.id
    head = _encode_json(body)
    if not binary:
        return head, {}
    return head + b"".join(chunks), {"Inference-Header-Content-Length": str(len(head))}
