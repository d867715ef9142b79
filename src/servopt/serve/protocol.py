"""Open Inference Protocol v2 (KServe / Triton) request and response codec, JSON and binary.

Triton's binary-tensor extension: the body starts with a JSON header of
``Inference-Header-Content-Length`` bytes; tensors whose ``parameters`` carry
``binary_data_size`` follow as raw little-endian bytes, in order. tritonclient
sends inputs that way by default (``binary_data=True``) and asks for binary
outputs, so a server must speak it to work with the stock client.

No library implements the server side of this codec for FastAPI (Triton and
KServe embed their own), so it is written here, strictly validated: every
malformed request becomes a ``BadRequest`` naming the problem, never a 500.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from servopt.spec import TensorSpec

DATATYPES = {
    "BOOL": np.dtype(bool), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16), "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64), "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
}
NP_TO_DATATYPE = {v.name: k for k, v in DATATYPES.items()}
HEADER = "inference-header-content-length"


class BadRequest(Exception):
    """A client error: answered 400 (or ``status``) with the message as ``{"error": ...}``."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


def datatype_of(dtype: str) -> str:
    return NP_TO_DATATYPE.get(np.dtype(dtype).name, "BYTES")


@dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    binary_outputs: bool
    requested_outputs: list[str] | None


def parse_infer_request(body: bytes, header_length: str | None, model_inputs: list[TensorSpec]) -> InferRequest:
    """Decode and validate a v2 infer request against the model's inputs."""
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
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list) or not header["inputs"]:
        raise BadRequest("the request needs an 'inputs' list of tensors")
    expected = {t.name: t for t in model_inputs}
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for i, tensor in enumerate(header["inputs"]):
        if not isinstance(tensor, dict):
            raise BadRequest(f"inputs[{i}] must be an object")
        name, shape, datatype = tensor.get("name"), tensor.get("shape"), tensor.get("datatype")
        if name not in expected:
            raise BadRequest(f"unknown input {name!r}; the model takes {sorted(expected)}")
        if name in inputs:
            raise BadRequest(f"input {name!r} given twice")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise BadRequest(f"input {name!r}: 'shape' must be a list of non-negative integers")
        if datatype not in DATATYPES:
            raise BadRequest(f"input {name!r}: datatype {datatype!r} is not supported ({', '.join(DATATYPES)})")
        spec = expected[name]
        want = datatype_of(spec.dtype)
        if datatype != want:
            raise BadRequest(f"input {name!r} has datatype {datatype}; the model expects {want}")
        _check_shape(name, shape, spec)
        count = math.prod(shape)
        dtype = DATATYPES[datatype]
        params = tensor.get("parameters") or {}
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if not isinstance(size, int) or size != count * dtype.itemsize:
                raise BadRequest(f"input {name!r}: binary_data_size {size} does not match shape {shape} of {datatype} "
                                 f"({count * dtype.itemsize} bytes)")
            if offset + size > len(binary):
                raise BadRequest(f"input {name!r}: the body holds {len(binary) - offset} bytes of binary data, {size} expected")
            arr = np.frombuffer(binary[offset:offset + size], dtype=dtype.newbyteorder("<"))
            if arr.dtype != dtype:  # only a big-endian host needs the byte swap; elsewhere the body is used as is
                arr = arr.astype(dtype)
            offset += size
        else:
            if "data" not in tensor:
                raise BadRequest(f"input {name!r} has no 'data' (or binary_data_size)")
            try:
                arr = np.asarray(tensor["data"], dtype=dtype).reshape(-1)
            except (ValueError, TypeError) as e:
                raise BadRequest(f"input {name!r}: 'data' cannot be read as {datatype}: {e}") from e
        if arr.size != count:
            raise BadRequest(f"input {name!r}: {arr.size} elements given, shape {shape} needs {count}")
        arr = arr.reshape(shape)
        # min/max propagate NaN and show ±inf: two reductions instead of a full boolean temporary.
        if arr.dtype.kind == "f" and arr.size and not (np.isfinite(arr.min()) and np.isfinite(arr.max())):
            raise BadRequest(f"input {name!r} contains NaN or infinity")
        inputs[name] = arr
    if offset != len(binary):
        raise BadRequest(f"{len(binary) - offset} bytes of binary data were not claimed by any input")
    missing = sorted(set(expected) - set(inputs))
    if missing:
        raise BadRequest(f"missing input(s) {missing}")
    batches = {a.shape[0] for a in inputs.values()}
    if len(batches) != 1:
        raise BadRequest(f"inputs disagree on the batch size: {sorted(batches)}")
    outputs = header.get("outputs")
    requested = None
    binary_out = bool((header.get("parameters") or {}).get("binary_data_output", False))
    if isinstance(outputs, list) and outputs:
        requested = [o.get("name") for o in outputs if isinstance(o, dict)]
        binary_out = any((o.get("parameters") or {}).get("binary_data", False) for o in outputs if isinstance(o, dict))
    return InferRequest(header.get("id"), inputs, binary_out, requested)


def _check_shape(name: str, shape: list[int], spec: TensorSpec) -> None:
    if len(shape) != len(spec.shape):
        raise BadRequest(f"input {name!r} has {len(shape)} dimensions {shape}; the model expects {len(spec.shape)} {_fmt(spec.shape)}")
    if shape[0] < 1:
        raise BadRequest(f"input {name!r}: the batch dimension must be at least 1")
    for i, (got, want) in enumerate(zip(shape, spec.shape, strict=True)):
        if i > 0 and isinstance(want, int) and want > 0 and got != want:
            raise BadRequest(f"input {name!r} has shape {shape}; the model expects {_fmt(spec.shape)}")


def _fmt(shape: list) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) and d > 0 else "-1" for d in shape) + "]"


def encode_infer_response(model_name: str, request_id: str | None, outputs: dict[str, np.ndarray],
                          binary: bool) -> tuple[bytes, dict[str, str]]:
    """(body, extra headers). Binary outputs go after the JSON header, as Triton answers."""
    header_outputs, chunks = [], []
    for name, arr in outputs.items():
        arr = np.ascontiguousarray(arr)
        entry = {"name": name, "shape": list(arr.shape), "datatype": datatype_of(arr.dtype.name)}
        if binary:
            raw = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        header_outputs.append(entry)
    body = {"model_name": model_name, "model_version": "1", "outputs": header_outputs}
    if request_id is not None:
        body["id"] = request_id
    head = json.dumps(body).encode()
    if not binary:
        return head, {}
    return head + b"".join(chunks), {"Inference-Header-Content-Length": str(len(head))}
