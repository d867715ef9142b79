"""What the load generator sends: requests encoded once, before any is timed, for every sender (an HTTP path, body and
content type; the same sample as a gRPC ``ModelInferRequest`` where it has one), and the pool a step draws from.

Requests are made from what the user serves: their evaluation tensors as binary tensors (OIP v2 ``/infer``), their
evaluation texts as OIP v2 ``BYTES`` (a text encoder's server tokenizes), their image files' bytes to ``/classify``
(the server decodes and preprocesses), or, with nothing given, one sample made from the model's metadata.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from servopt.contracts import ServedData
from servopt.errors import UserError
from servopt.serve.protocol import DATATYPES, encode_raw_tensor

SENTENCE = "A short sentence to embed, as a client would send it."  # a BYTES input's sample when no text is given


@dataclass(frozen=True, eq=False)
class Request:
    """One request, encoded once: ``path`` and ``body`` over HTTP with ``content_type`` (and ``headers``), and the same
    sample as a gRPC ``ModelInferRequest`` (``grpc``) where it has one (a ``/classify`` image has none)."""

    path: str
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    grpc: Any = None


@dataclass
class Pool:
    """The requests a run draws from: each one drawn at random (seeded), so a short step is a fair sample of them all
    (the user's long texts and short ones in the proportion they come), and two steps of the same seed send the same."""

    requests: Sequence[Request]
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.requests:
            raise UserError("no request to send", fix="give the load generator at least one sample")
        self._rng = random.Random(self.seed)

    def next(self) -> Request:
        reqs = self.requests
        return reqs[0] if len(reqs) == 1 else reqs[self._rng.randrange(len(reqs))]

    def reseed(self, seed: int) -> Pool:
        return Pool(self.requests, seed)


def json_request(path: str, body: dict) -> Request:
    return Request(path, json.dumps(body).encode())


def tensor_request(meta: dict, arrays: dict[str, np.ndarray], binary: bool = True, grpc: bool = False) -> Request:
    """One ``/infer`` request carrying ``arrays`` (batch first; an object array for a BYTES input), for the model
    ``GET /v2/models/{name}`` describes: Triton binary tensors (``binary``: the JSON header, then the raw bytes), or
    plain JSON; ``grpc``: with its ``ModelInferRequest`` too."""
    path = f"/v2/models/{meta['name']}/infer"
    datatypes = {t["name"]: t["datatype"] for t in meta["inputs"]}
    entries, blobs = [], []
    for name, arr in arrays.items():
        entry: dict[str, Any] = {"name": name, "shape": list(arr.shape), "datatype": datatypes[name]}
        if binary:
            raw = encode_raw_tensor(arr)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            flat = arr.reshape(-1)
            entry["data"] = [x.decode() if isinstance(x, bytes) else x for x in flat.tolist()]
        entries.append(entry)
    header: dict[str, Any] = {"inputs": entries}
    message = None
    if grpc:
        from servopt.serve.proto import grpc_service_pb2 as pb

        message = pb.ModelInferRequest(
            model_name=meta["name"], inputs=[pb.ModelInferRequest.InferInputTensor(name=n, datatype=datatypes[n], shape=a.shape)
                                             for n, a in arrays.items()],
            raw_input_contents=[encode_raw_tensor(a) for a in arrays.values()])
    if not binary:
        return Request(path, json.dumps(header).encode(), grpc=message)
    header["outputs"] = [{"name": o["name"], "parameters": {"binary_data": True}} for o in meta["outputs"]]
    head = json.dumps(header).encode()
    return Request(path, head + b"".join(blobs), "application/octet-stream",
                   (("Inference-Header-Content-Length", str(len(head))),), message)


def synthetic_sample(meta: dict, batch: int = 1, seed: int = 0, text: str | None = None) -> dict[str, np.ndarray]:
    """A sample made from the model's metadata (dynamic axes 16): normal floats, ones for integers, ``text`` (or a
    short sentence) for a BYTES input. For ``servopt loadtest`` without data; a capacity is measured on the user's."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for t in meta["inputs"]:
        shape = [batch] + [d if d > 0 else 16 for d in t["shape"][1:]]
        if t["datatype"] == "BYTES":
            arr = np.empty(shape, dtype=object)
            arr[...] = (text or SENTENCE).encode()
        else:
            dtype = DATATYPES[t["datatype"]]
            arr = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else np.ones(shape, dtype=dtype)
        arrays[t["name"]] = arr
    return arrays


def text_requests(meta: dict, texts: Iterable[str], grpc: bool = False) -> list[Request]:
    """One text a request, as OIP v2 ``BYTES`` in JSON (what a client of a text encoder sends: the server tokenizes)."""
    names = [t["name"] for t in meta["inputs"] if t["datatype"] == "BYTES"]
    if not names:
        raise UserError(f"the model {meta['name']!r} takes no text (no BYTES input)", fix="send its tensors instead")
    out = []
    for text in texts:
        arr = np.empty(1, dtype=object)
        arr[0] = text.encode("utf-8", "surrogatepass")
        out.append(tensor_request(meta, {names[0]: arr}, binary=False, grpc=grpc))
    return out


def sample_requests(meta: dict, inputs: dict[str, np.ndarray], lengths: np.ndarray | None = None, binary: bool = True,
                    grpc: bool = False, limit: int = 512) -> list[Request]:
    """One sample a request, for up to ``limit`` samples of ``inputs`` (batch first; ``lengths``: a variable-length
    input's real length per sample, so each request carries that sample unpadded), as binary tensors."""
    count = len(next(iter(inputs.values())))
    take = np.linspace(0, count - 1, min(count, limit)).round().astype(int) if count > limit else np.arange(count)
    out = []
    for i in take:
        width = int(lengths[i]) if lengths is not None else None
        sample = {k: np.ascontiguousarray(v[i:i + 1, :width] if width is not None and v.ndim > 1 else v[i:i + 1])
                  for k, v in inputs.items()}
        out.append(tensor_request(meta, sample, binary=binary, grpc=grpc))
    return out


IMAGE_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp", ".bmp": "image/bmp"}


def image_requests(model: str, files: Iterable[str | Path]) -> list[Request]:
    """Each image file's bytes to ``/v2/models/{model}/classify``, as a client of the image endpoint sends them."""
    out = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise UserError(f"no image file {path}", fix="pass image files (or a folder of them) that exist")
        out.append(Request(f"/v2/models/{model}/classify", path.read_bytes(),
                           IMAGE_TYPES.get(path.suffix.lower(), "application/octet-stream")))
    if not out:
        raise UserError("no image to send", fix="pass a folder with .jpg/.png images")
    return out


def image_files(folder_or_file: Path, limit: int = 512) -> list[Path]:
    """The images of a folder (recursively, sorted; at most ``limit``, spread over it), or the one file given."""
    if folder_or_file.is_file():
        return [folder_or_file]
    files = sorted(p for p in folder_or_file.rglob("*") if p.suffix.lower() in IMAGE_TYPES)
    if len(files) > limit:
        files = [files[i] for i in np.linspace(0, len(files) - 1, limit).round().astype(int)]
    return files


def served_requests(meta: dict, data: ServedData, grpc: bool = False) -> tuple[list[Request], str]:
    """The user's evaluation data as the served model receives it, and what that is in words: the image files to
    ``/classify`` where ``data.images`` names them; the model's own inputs from ``eval.npz`` (one sample a request)
    where the server takes them; the evaluation texts (token ids decoded) where it takes strings."""
    from servopt.data.dataset import Dataset
    from servopt.data.text import decode_texts

    if data.images:
        files = data.images[:512]
        return image_requests(meta["name"], files), (f"{len(files)} evaluation images, their files' bytes to /classify "
                                                     "(the server decodes and preprocesses), one a request")
    ds = Dataset.load(Path(data.eval_data))
    wanted = {t["name"] for t in meta["inputs"]}
    if wanted <= set(ds.inputs):
        reqs = sample_requests(meta, {k: v for k, v in ds.inputs.items() if k in wanted}, ds.lengths, grpc=grpc)
        size = sum(len(r.body) for r in reqs) / len(reqs) / 1024
        return reqs, f"{len(reqs)} evaluation samples as binary tensors (about {size:.0f} KB a request), one a request"
    if any(t["datatype"] == "BYTES" for t in meta["inputs"]):
        texts = decode_texts(data.tokenizer, ds.inputs) if data.tokenizer else None
        if not texts:
            raise UserError("the served model takes texts, and the evaluation data has no token ids to decode with a "
                            "tokenizer", fix="serve a text encoder loaded from its Hugging Face folder (its tokenizer.json)")
        texts = texts[:512]
        chars = sorted(len(t) for t in texts)
        return text_requests(meta, texts, grpc), (f"{len(texts)} evaluation texts ({chars[len(chars) // 2]} characters at "
                                                  "the median), one a request as OIP v2 BYTES (the server tokenizes)")
    raise UserError(f"the served model's inputs {sorted(wanted)} are not the evaluation data's {sorted(ds.inputs)}",
                    fix="serve the run's own model (its inputs are what the evaluation data holds)")
