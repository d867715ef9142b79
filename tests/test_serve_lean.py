"""The lean serving path answers exactly as the general one: the inference routes ahead of FastAPI's stack against
the same routes through it, orjson against the standard library's JSON, batches filled in place against np.pad, and
small requests prepared on the event loop while larger ones still go to a worker thread."""

from __future__ import annotations

import base64
import json
import threading

import httpx
import numpy as np
import pytest

from conftest import LiveServer
from servopt.families.text import TextEmbedding
from servopt.serve.protocol import BadRequest, InferResponse, decode_json, decode_rest_request, encode_rest_response
from servopt.serve.rest import openai_embeddings_body
from servopt.settings import ServeSettings
from test_text_serving import tiny_text_encoder

KEY = "lean-key"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    encoder = tiny_text_encoder(tmp_path_factory.mktemp("lean"))
    with LiveServer(encoder, ServeSettings(max_delay_us=0, max_body_mb=0.01, api_key=KEY), name="tiny") as s:
        yield s


AUTH = {"Authorization": f"Bearer {KEY}"}


def _binary_text_request(items: list[bytes]) -> tuple[bytes, dict]:
    head = json.dumps({"inputs": [{"name": "text", "shape": [len(items)], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": sum(4 + len(b) for b in items)}}],
                       "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}]}).encode()
    return head + b"".join(len(b).to_bytes(4, "little") + b for b in items), {"Inference-Header-Content-Length": str(len(head))}


def _corpus() -> list[tuple[str, dict]]:
    texts = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["the cat sat", "a dog"]}], "id": "r1"}
    binary, binary_headers = _binary_text_request([b"the cat", b"a dog ran"])
    return [
        ("/v1/embeddings", {"json": {"model": "tiny", "input": "the cat sat on the mat", "encoding_format": "base64"}}),
        ("/v1/embeddings", {"json": {"model": "tiny", "input": ["the cat", "a dog"], "encoding_format": "float"}}),
        ("/v1/embeddings", {"json": {"model": "tiny", "input": [[2, 4, 5, 3], [2, 9, 3]], "dimensions": 2}}),
        ("/v1/embeddings", {"json": {"model": "tiny", "input": [[2, 40, 3]]}}),  # past the vocabulary: 400
        ("/v1/embeddings", {"json": {"model": "nope", "input": "x"}}),  # 404 in OpenAI's shape
        ("/v1/embeddings", {"json": {"model": "tiny", "input": "x", "encoding_format": "int8"}}),
        ("/v1/embeddings", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}),
        ("/v1/embeddings", {"content": b"[" * 5000 + b"]" * 5000}),
        ("/v1/embeddings", {"json": {"model": "tiny", "input": "x"}, "auth": False}),  # 401
        ("/v1/embeddings", {"content": b"x" * 20_000}),  # over the 10 kB body limit: 413
        ("/v2/models/tiny/infer", {"json": texts}),
        ("/v2/models/tiny/infer", {"content": binary, "headers": binary_headers}),
        ("/v2/models/tiny/infer", {"content": binary, "headers": {"Inference-Header-Content-Length": "99999"}}),
        ("/v2/models/tiny/infer", {"json": {"inputs": [{"name": "text", "shape": [1], "datatype": "INT64", "data": [2 ** 70]}]}}),
        ("/v2/models/tiny/infer", {"json": {"inputs": [{"name": "input_ids", "shape": [1, 3], "datatype": "INT64",
                                                        "data": [2, 5, 3]}]}}),
        ("/v2/models/nope/infer", {"json": texts}),  # 404
        ("/v2/models/tiny/infer", {"content": b"\xff\xfe", "headers": {"Content-Type": "application/json"}}),
    ]


def _send(url: str, path: str, how: dict) -> httpx.Response:
    how = dict(how)
    headers = {**(AUTH if how.pop("auth", True) else {}), **how.pop("headers", {})}
    return httpx.post(url + path, headers=headers, timeout=30, **how)


def _same(a: httpx.Response, b: httpx.Response, what: str) -> None:
    assert a.status_code == b.status_code, (what, a.status_code, b.status_code, a.text, b.text)
    for header in ("content-type", "retry-after", "connection", "inference-header-content-length", "www-authenticate"):
        assert a.headers.get(header) == b.headers.get(header), (what, header)
    if a.headers.get("content-type") == "application/json":
        assert _floats32(a.json()) == _floats32(b.json()), what
    else:
        assert a.content == b.content, what


def _floats32(doc):
    """Floats as float32 values: orjson writes a float32 shortest, the standard library its float64 expansion."""
    if isinstance(doc, float):
        return float(np.float32(doc))
    if isinstance(doc, list):
        return [_floats32(x) for x in doc]
    if isinstance(doc, dict):
        return {k: _floats32(v) for k, v in doc.items()}
    return doc


@pytest.mark.slow  # over a second: `make test` runs it
def test_the_inference_routes_answer_as_through_fastapi(tiny):
    """Every request of the corpus (good, bad, unauthorized, too large) gets the same status, headers and body from the
    routes served ahead of FastAPI's stack as from the same routes through it; and the fast way is really taken."""
    app, taken = tiny.app, []
    hot = app.hot

    async def counted(scope, receive, send):
        taken.append(scope["path"])
        await hot(scope, receive, send)

    corpus = _corpus()
    app.hot = counted
    try:
        fast = [_send(tiny.url, path, how) for path, how in corpus]
    finally:
        app.hot = None
    try:
        slow = [_send(tiny.url, path, how) for path, how in corpus]
    finally:
        app.hot = hot
    assert len(taken) == len(corpus) - 2  # all but the 401 and the 413, refused by GuardMiddleware before any handler
    for (path, how), a, b in zip(corpus, fast, slow, strict=True):
        _same(a, b, f"{path} {how}")
    assert {r.status_code for r in fast} == {200, 400, 401, 404, 413}
    counts = _metrics(tiny.url)
    assert not [k for k in counts if k.startswith("servopt_requests_total") and 'code="500"' in k]
    assert counts['servopt_requests_total{code="200",endpoint="v2/models/{name}/infer"}'] == 4  # 2 each way
    assert counts['servopt_requests_total{code="413",endpoint="v1/embeddings"}'] == 2


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def test_other_methods_and_routes_still_go_through_fastapi(tiny):
    assert httpx.get(f"{tiny.url}/v1/embeddings", headers=AUTH).status_code == 405
    assert httpx.post(f"{tiny.url}/v2/models/tiny/infer/", headers=AUTH, json={}).status_code in (307, 404)
    assert httpx.get(f"{tiny.url}/v2/models/tiny", headers=AUTH).json()["inputs"][0]["name"] == "text"


@pytest.mark.parametrize("body", [b'{"a": 1, "a": 2}', b"[1e400]", b"[NaN, -Infinity]", b"[123456789012345678901]",
                                  b"[-9223372036854775809, 18446744073709551616]", b'["\\ud800"]', b"\xef\xbb\xbf[1]",
                                  '["é"]'.encode("utf-16"), b' {"x": [0.1, -0.0, 1.5e-320]} ', b'{"s": "\\u00e9\\n"}'])
def test_decode_json_reads_what_the_standard_library_reads(body):
    assert repr(decode_json(body)) == repr(json.loads(body))


@pytest.mark.parametrize("body", [b"", b"{not json", b"[" * 200_000 + b"]" * 200_000, b"\xff\xfe garbage"])
def test_decode_json_refuses_what_the_standard_library_refuses(body):
    with pytest.raises(BadRequest):
        decode_json(body)


def test_an_integer_past_64_bits_is_refused_not_wrapped():
    """orjson would read 2**70 as a float, which NumPy casts to int64 without a word; the standard library's int is
    refused as it always was."""
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": [2 ** 70]}]}).encode()
    with pytest.raises(BadRequest, match="cannot be read as INT64"):
        decode_rest_request(body, None)
    fits = json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "UINT64", "data": [2 ** 64 - 1, 7]}]}).encode()
    assert decode_rest_request(fits, None).inputs[0].data.tolist() == [2 ** 64 - 1, 7]


def _answer(outputs: dict, request_id: str | None = None) -> dict:
    content, _ = encode_rest_response(InferResponse(model_name="m", id=request_id, outputs=outputs, parameters={"tokens": 3}), False)
    return json.loads(content)


def test_json_outputs_keep_their_values():
    x = np.random.default_rng(0).standard_normal((3, 384)).astype(np.float32)
    got = _answer({"e": x}, "r1")
    assert got["id"] == "r1" and got["parameters"] == {"tokens": 3} and got["outputs"][0]["shape"] == [3, 384]
    assert np.array_equal(np.asarray(got["outputs"][0]["data"], np.float32).reshape(3, 384), x)  # float32 exactly
    assert _answer({"i": np.array([[2 ** 63 - 1, -5]])})["outputs"][0]["data"] == [2 ** 63 - 1, -5]
    assert _answer({"b": np.array([True, False])})["outputs"][0]["data"] == [True, False]
    assert _answer({"s": np.array([b"caf\xc3\xa9", b"x"], dtype=object)})["outputs"][0]["data"] == ["café", "x"]
    nan = _answer({"e": np.array([np.nan, np.inf, 1.0], np.float32)})["outputs"][0]["data"]  # written as before: NaN
    assert np.isnan(nan[0]) and nan[1] == float("inf") and nan[2] == 1.0
    assert _answer({"e": x[:1]}, "\ud800")["id"] == "\ud800"  # a lone surrogate in the id, as the stdlib writes it


def test_openai_bodies_carry_the_exact_float32_values():
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    b64 = json.loads(openai_embeddings_body(x, "base64", "m", 7))
    assert b64["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and b64["model"] == "m" and b64["object"] == "list"
    assert [d["index"] for d in b64["data"]] == [0, 1]
    assert np.array_equal(np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64["data"]]), x)
    floats = json.loads(openai_embeddings_body(x.astype(np.float64), "float", "m", 7))
    assert np.array_equal(np.asarray([d["embedding"] for d in floats["data"]], np.float32), x)


def test_collate_fills_a_batch_as_padding_each_request_would():
    rng = np.random.default_rng(2)
    feeds = []
    for rows, width in ((1, 7), (3, 12), (2, 3)):
        feeds.append({"input_ids": rng.integers(1, 100, (rows, width)), "attention_mask": np.ones((rows, width), np.int64),
                      "token_type_ids": rng.integers(0, 2, (rows, width))})
    got = TextEmbedding().collate(feeds)
    for name in feeds[0]:
        want = np.concatenate([np.pad(f[name], ((0, 0), (0, 12 - f[name].shape[1]))) for f in feeds])
        assert got[name].dtype == want.dtype and np.array_equal(got[name], want), name


def test_small_requests_are_prepared_on_the_event_loop_larger_ones_in_a_worker(tiny, monkeypatch):
    """One short text (or a few token ids) is tokenized on the event loop: cheaper than the hand-off to a worker thread.
    Several texts, or a long one, still go to a worker, so the loop is never held long."""
    threads: list[str] = []
    original = TextEmbedding.model_inputs

    def spy(self, spec, inputs, params):
        threads.append(threading.current_thread().name)
        return original(self, spec, inputs, params)

    monkeypatch.setattr(TextEmbedding, "model_inputs", spy)
    loop_thread = tiny.thread.name
    for value, where in (("the cat sat", "loop"), (["the cat"] * 5, "worker"), ("the " * 200, "worker"), ([2, 5, 3], "loop")):
        r = httpx.post(f"{tiny.url}/v1/embeddings", headers=AUTH, json={"model": "tiny", "input": value})
        assert r.status_code == 200, r.text
        assert (threads[-1] == loop_thread) == (where == "loop"), (value, threads[-1], loop_thread)


def test_a_request_reads_no_package_metadata(tiny, monkeypatch):
    """Plugins are found once per process: a scan of the installed packages' entry points (every package's metadata
    read from disk) on each request's family lookup cost 7 ms of a 13 ms one-sentence request (issue 19)."""
    from importlib import metadata

    scans: list[str] = []
    original = metadata.entry_points

    def spy(*args, **kwargs):
        scans.append(str(kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(metadata, "entry_points", spy)
    for _ in range(3):
        for route, body in (("/v1/embeddings", {"model": "tiny", "input": "the cat sat"}),
                            ("/v2/models/tiny/infer", {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a dog"]}]})):
            r = httpx.post(f"{tiny.url}{route}", headers=AUTH, json=body)
            assert r.status_code == 200, r.text
    assert scans == []


@pytest.mark.parametrize("names", [("input_ids", "attention_mask", "token_type_ids"), ("input_ids", "attention_mask")])
def test_one_pass_tokenizing_gives_what_encode_and_pad_batch_give(tmp_path, names):
    """The server's tokenizing (``encode_padded``) against the general two steps, on texts of one length, of several,
    and over the model's length (cut, with the full length said), lowercased as the model's tokenizer asks."""
    from servopt.data.text import TextTokenizer, pad_batch

    encoder = tiny_text_encoder(tmp_path)
    tok = TextTokenizer(encoder.parent / "tokenizer.json", 8, lowercase=True)
    for texts in (["The cat"], ["the cat", "a dog"], ["the cat sat", "a", "the dog ran on the mat a cat sat on a mat", ""]):
        feed, lengths, cut = tok.encode_padded(texts, names)
        encoded = tok.encode(texts)
        want = pad_batch(encoded, names, pad_id=tok.pad_id)
        assert list(feed) == list(want)
        for n in names:
            assert feed[n].dtype == want[n].dtype and np.array_equal(feed[n], want[n]), (texts, n)
        assert lengths == [len(e.ids) for e in encoded]
        assert cut == {i: e.full_length for i, e in enumerate(encoded) if e.truncated}
    assert cut == {2: 14}  # [CLS] + 12 words + [SEP], cut to 8


def test_middleware_added_after_create_app_wraps_the_inference_routes_too(tmp_path):
    """Ray Serve adds its replica header to the app ``create_app`` returns: the routes served ahead of FastAPI's stack
    go through it as every other route does, answers and refusals alike."""
    from servopt.serve.dataplane import DataPlane
    from servopt.serve.model import from_file

    class Stamp:
        def __init__(self, app) -> None:
            self.app = app

        async def __call__(self, scope, receive, send) -> None:
            async def stamped(message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []), (b"x-stamp", b"1")]
                await send(message)

            await self.app(scope, receive, stamped)

    plane = DataPlane({"tiny": from_file(tiny_text_encoder(tmp_path), "tiny")}, ServeSettings(max_delay_us=0))
    server = LiveServer(plane)
    server.app.add_middleware(Stamp)
    with server as s:
        texts = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["the cat"]}]}
        for path, body, status in (("/v1/embeddings", {"model": "tiny", "input": "the cat"}, 200), ("/v2/models/tiny/infer", texts, 200),
                                   ("/v1/embeddings", {"model": "nope", "input": "x"}, 404), ("/v2/models/tiny", None, 200)):
            r = httpx.post(s.url + path, json=body) if body is not None else httpx.get(s.url + path)
            assert r.status_code == status and r.headers.get("x-stamp") == "1", (path, r.status_code, r.headers)
