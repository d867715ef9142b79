"""The real server on a free loopback port: tritonclient (binary and JSON), the image endpoint,
bad requests, batching, overload, auth, fuzzing, the load generator, packaging, lean imports."""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from conftest import LiveServer, TinyNet, assert_runs_without, tiny_classifier_onnx
from servopt.cli import app as cli_app
from servopt.serve.model import from_file
from servopt.serve.rest import create_app
from servopt.settings import ServeSettings

LABELS = ["cat", "dog", "fish"]


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory) -> Path:
    """A tiny image classifier with servopt metadata (labels, preprocessing), like `servopt export` writes."""
    return tiny_classifier_onnx(tmp_path_factory.mktemp("serve") / "tiny.onnx", LABELS)


def direct(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


@pytest.fixture(scope="module")
def server(onnx_model):
    with LiveServer(onnx_model, ServeSettings(max_batch=16, max_delay_us=20_000, max_body_mb=1.0, max_image_pixels=1_000_000)) as s:
        yield s


def healthy(url: str) -> bool:
    return httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_infer(server, onnx_model, binary):
    import tritonclient.http as tc

    client = tc.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    meta = client.get_model_metadata("tiny")
    assert meta["inputs"][0] == {"name": "input", "datatype": "FP32", "shape": [-1, 3, 32, 32]}
    assert client.get_model_config("tiny")["max_batch_size"] == 16
    x = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    inp = tc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = tc.InferRequestedOutput("logits", binary_data=binary)
    result = client.infer("tiny", [inp], outputs=[out])
    np.testing.assert_allclose(result.as_numpy("logits"), direct(onnx_model, x), rtol=1e-4, atol=1e-5)


def test_plain_json_nested_data(server, onnx_model):
    x = np.random.default_rng(2).standard_normal((1, 3, 32, 32)).astype(np.float32)
    body = {"id": "r1", "inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": x.tolist()}]}
    r = httpx.post(f"{server.url}/v2/models/tiny/infer", json=body)
    assert r.status_code == 200 and r.json()["id"] == "r1"
    got = np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(1, 3)
    np.testing.assert_allclose(got, direct(onnx_model, x), rtol=1e-4, atol=1e-5)


def _png(size=(40, 40), colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_classify_raw_and_multipart(server):
    raw = httpx.post(f"{server.url}/v2/models/tiny/classify?top_k=2", content=_png(), headers={"Content-Type": "image/png"})
    assert raw.status_code == 200, raw.text
    preds = raw.json()["predictions"]
    assert len(preds) == 2 and preds[0]["label"] in LABELS and preds[0]["probability"] >= preds[1]["probability"]
    multi = httpx.post(f"{server.url}/v2/models/tiny/classify?top_k=2", files={"file": ("x.png", _png(), "image/png")})
    assert multi.status_code == 200 and multi.json()["predictions"] == preds


def _bad_requests() -> list[tuple[str, dict, int, str]]:
    good = {"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}
    nan = {**good, "data": [float("nan")] + [0.0] * 3071}
    big_png = io.BytesIO()
    Image.new("1", (2000, 2000)).save(big_png, format="PNG")
    return [
        ("infer", {"json": {"inputs": [{**good, "name": "pixels"}]}}, 400, "unknown input 'pixels'"),
        ("infer", {"json": {"inputs": [{**good, "shape": [1, 3, 16, 16], "data": [0.0] * 768}]}}, 400, "model expects [-1, 3, 32, 32]"),
        ("infer", {"json": {"inputs": [{**good, "datatype": "INT64", "data": [0] * 3072}]}}, 400, "model expects FP32"),
        ("infer", {"json": {"inputs": [{**good, "data": [0.0] * 100}]}}, 400, "100 elements given"),
        ("infer", {"content": json.dumps({"inputs": [nan]}).replace("NaN", "NaN"), "headers": {"Content-Type": "application/json"}}, 400, "NaN"),
        ("infer", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 400, "not valid JSON"),
        # Nested deeper than the decoder's recursion limit: a RecursionError inside json.loads, answered 400, not 500.
        ("infer", {"content": b'{"inputs": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "headers": {"Content-Type": "application/json"}},
         400, "nested too deeply"),
        ("infer", {"json": {"inputs": []}}, 400, "'inputs' list"),
        ("infer", {"json": {"inputs": [{**good, "datatype": "COMPLEX"}]}}, 400, "not supported"),
        ("infer", {"content": b'{"inputs":[{"name":"input","shape":[1,3,32,32],"datatype":"FP32","parameters":{"binary_data_size":12288}}]}',
                   "headers": {"Inference-Header-Content-Length": "999999"}}, 400, "outside the body"),
        ("infer", {"content": b"x" * (2 * 1024 * 1024), "headers": {"Content-Type": "application/json"}}, 413, "limit"),
        ("classify", {"content": b"hello", "headers": {"Content-Type": "text/plain"}}, 415, "not an image"),
        ("classify", {"content": b"\x89PNG\r\n\x1a\n garbage", "headers": {"Content-Type": "image/png"}}, 400, "cannot decode"),
        ("classify", {"content": _png()[:50], "headers": {"Content-Type": "image/png"}}, 400, "cannot decode"),
        ("classify", {"content": big_png.getvalue(), "headers": {"Content-Type": "image/png"}}, 400, "decompression bomb"),
        ("classify", {"content": b"", "headers": {"Content-Type": "image/png"}}, 400, "empty"),
        ("classify?top_k=0", {"content": _png(), "headers": {"Content-Type": "image/png"}}, 400, "top_k"),
        ("classify?top_k=abc", {"content": _png(), "headers": {"Content-Type": "image/png"}}, 400, "top_k"),
    ]


@pytest.mark.parametrize(("route", "kwargs", "status", "message"), _bad_requests())
def test_bad_requests_get_clear_4xx(server, route, kwargs, status, message):
    r = httpx.post(f"{server.url}/v2/models/tiny/{route}", **kwargs)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert healthy(server.url)


def test_unknown_model_and_route(server):
    r = httpx.post(f"{server.url}/v2/models/nope/infer", json={"inputs": []})
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]
    assert httpx.get(f"{server.url}/v2/nothing").json() == {"error": "no such route"}
    httpx.get(f"{server.url}/v2/a%0Db%20c/{'x' * 50}")  # a raw CR and a space in the path
    text = httpx.get(f"{server.url}/metrics").text
    labels = {line.split('endpoint="')[1].split('"')[0] for line in text.split("\n") if 'endpoint="' in line}
    assert labels <= {"other", "metrics", "v2/models/{name}/infer", "v2/models/{name}/classify", "v2/models/{name}",
                      "v2/models/{name}/config", "v2/models/{name}/ready", "v2/health/ready", "v2/health/live", "v2",
                      "openapi.json", "docs"}, labels


def test_batching_happens_and_answers_go_to_the_right_caller(server, onnx_model):
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((1 + i % 2, 3, 32, 32)).astype(np.float32) for i in range(24)]

    def call(x: np.ndarray) -> np.ndarray:
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]}
        r = httpx.post(f"{server.url}/v2/models/tiny/infer", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(len(x), 3)

    before = _metric(server.url, "servopt_batch_size_count")
    with ThreadPoolExecutor(max_workers=24) as pool:
        answers = list(pool.map(call, xs))
    for x, got in zip(xs, answers, strict=True):
        np.testing.assert_allclose(got, direct(onnx_model, x), rtol=1e-4, atol=1e-5)
    batches = _metric(server.url, "servopt_batch_size_count") - before
    assert batches < len(xs), "several requests must have shared a model call"
    assert _metric(server.url, "servopt_batch_size_bucket{le=\"1.0\"}") < _metric(server.url, "servopt_batch_size_count")
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("servopt_queue_seconds_bucket", "servopt_compute_seconds_bucket", "servopt_queue_depth",
                 'servopt_requests_total{code="200",endpoint="v2/models/{name}/infer"}'):
        assert name in text, name


def _metric(url: str, name: str) -> float:
    """One sample of the Prometheus text exposition, by its full name (labels included)."""
    samples = dict(line.rsplit(" ", 1) for line in httpx.get(f"{url}/metrics").text.splitlines() if line and not line.startswith("#"))
    return float(samples.get(name, 0.0))


def _samples(n: int = 1) -> dict:
    return {"inputs": [{"name": "input", "shape": [n, 3, 32, 32], "datatype": "FP32", "data": [0.0] * (3072 * n)}]}


def _infer(url: str, n: int = 1, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/tiny/infer", json=_samples(n), timeout=timeout)


def _refusals(s) -> float:
    return sum(s.metric(f'servopt_refused_total{{reason="{r}"}}') for r in ("expected_wait", "queue_full")) + s.metric("servopt_dropped_total")


def test_more_samples_than_the_queue_holds_is_413_and_a_full_queue_503(onnx_model):
    """A request the queue could never hold is too large (413, no Retry-After: retrying cannot help); a flood of small
    ones is served or refused at once (503), none hangs, and every refusal is counted."""
    with LiveServer(onnx_model, ServeSettings(max_batch=1, max_delay_us=0, max_queue=2)) as s:
        r = _infer(s.url, 8, timeout=10)
        assert r.status_code == 413 and "the queue holds at most 2" in r.json()["error"] and "Retry-After" not in r.headers
        assert _infer(s.url, 2).status_code == 200

        async def flood() -> list[int]:
            async with httpx.AsyncClient(timeout=20) as c:
                rs = await asyncio.gather(*(c.post(f"{s.url}/v2/models/tiny/infer", json=_samples()) for _ in range(64)))
            return [r.status_code for r in rs]

        codes = asyncio.run(flood())  # none hangs: gather returns within the client timeout
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes
        assert _refusals(s) == codes.count(503)
        assert healthy(s.url) and _infer(s.url).status_code == 200


def test_a_request_expected_to_wait_past_the_budget_is_refused_at_once(onnx_model):
    """The model is estimated at 60 s a call and one call is in flight: a new request would wait about a minute,
    over the 1 s budget, so it is refused before it is read (503 + Retry-After) and never reaches the model."""
    with LiveServer(onnx_model, ServeSettings(max_batch=1, max_delay_us=0, latency_budget_ms=1000)) as s:
        s.estimate(60.0)
        held = s.hold()
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(_infer, s.url)
            held.wait_for_calls(1)
            r = _infer(s.url, timeout=10)
            assert r.status_code == 503, r.text
            assert "overloaded" in r.json()["error"] and "the latency budget is 1000 ms" in r.json()["error"]
            assert int(r.headers["Retry-After"]) >= 30  # about the minute the call in flight has left
            assert s.metric("servopt_expected_wait_seconds") > 30
            held.release()
            assert first.result().status_code == 200
        assert held.calls == [1]
        assert s.metric('servopt_refused_total{reason="expected_wait"}') == 1


def test_requests_expected_to_wait_within_the_budget_are_queued_and_served(onnx_model):
    with LiveServer(onnx_model, ServeSettings(max_batch=1, max_delay_us=0, latency_budget_ms=10_000)) as s:
        s.estimate(0.001)  # a queue of a few samples is a few ms: well within the budget
        held = s.hold()
        with ThreadPoolExecutor(max_workers=4) as pool:
            first = pool.submit(_infer, s.url)
            held.wait_for_calls(1)
            queued = [pool.submit(_infer, s.url) for _ in range(3)]
            deadline = time.time() + 10
            while s.batcher().depth < 3 and time.time() < deadline:
                time.sleep(0.01)
            assert s.batcher().depth == 3
            held.release()
            assert [f.result().status_code for f in (first, *queued)] == [200] * 4
        assert held.calls == [1, 1, 1, 1] and _refusals(s) == 0


def test_a_queued_request_that_waited_past_the_budget_is_dropped_before_it_runs(onnx_model):
    """Admitted (the estimate said no wait), then held behind a call that overran: once it has waited past the 200 ms
    budget it is answered 503 instead of being run late."""
    with LiveServer(onnx_model, ServeSettings(max_batch=1, max_delay_us=0, latency_budget_ms=200)) as s:
        s.estimate(0.001)
        held = s.hold()
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(_infer, s.url)
            held.wait_for_calls(1)
            late = pool.submit(_infer, s.url)
            deadline = time.time() + 10
            while s.batcher().depth < 1 and time.time() < deadline:
                time.sleep(0.01)
            assert s.batcher().depth == 1  # admitted and queued
            time.sleep(0.3)  # past the budget while the model is still busy
            held.release()
            r = late.result()
            assert r.status_code == 503 and "dropped after waiting" in r.json()["error"] and r.headers["Retry-After"], r.text
            assert first.result().status_code == 200
        assert held.calls == [1]  # the dropped request never ran
        assert s.metric("servopt_dropped_total") == 1 and s.metric('servopt_refused_total{reason="expected_wait"}') == 0


def test_a_chunked_multipart_upload_is_capped(server):
    """No Content-Length to refuse up front: the body is counted as it arrives and refused past --max-body-mb (1 MB
    here), instead of the multipart parser spooling any size of file part."""
    boundary = "servopt-test-boundary"

    def body():
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.png\"\r\n"
               "Content-Type: image/png\r\n\r\n").encode()
        for _ in range(24):
            yield b"\0" * 65536  # 1.5 MB
        yield f"\r\n--{boundary}--\r\n".encode()

    r = httpx.post(f"{server.url}/v2/models/tiny/classify", content=body(),
                   headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}, timeout=30)
    assert r.status_code == 413 and "over the 1048576-byte limit" in r.json()["error"], r.text
    small = httpx.post(f"{server.url}/v2/models/tiny/classify", content=iter([_png()]), headers={"Content-Type": "image/png"})
    assert small.status_code == 200, small.text  # a chunked body under the limit is read as before
    assert healthy(server.url)


def test_bearer_token(onnx_model):
    with LiveServer(onnx_model, ServeSettings(api_key="s3cret")) as s:
        assert httpx.get(f"{s.url}/v2/health/live").status_code == 200
        r = httpx.get(f"{s.url}/v2/models/tiny")
        assert r.status_code == 401 and "bearer" in r.json()["error"]
        assert httpx.get(f"{s.url}/v2/models/tiny", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{s.url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401


@pytest.mark.slow
def test_openapi_fuzz_finds_no_5xx(server):
    """Property-based fuzz of every operation in the server's OpenAPI schema (schemathesis strategies).

    Driven with hypothesis directly: schemathesis 4.32's pytest plugin fails under pytest 9 ('_nodeid')."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8

    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            response = case.call()
            assert response.status_code < 500, (case.method, case.formatted_path, response.status_code, response.text[:200])

        fuzz()
    assert healthy(server.url)


@pytest.mark.slow
def test_loadtest_cli(server, tmp_path):
    out = tmp_path / "lt.json"
    r = CliRunner().invoke(cli_app, ["loadtest", server.url, "--model", "tiny", "--concurrency", "1,4", "--rate", "30",
                                     "--duration", "1", "--warmup", "0.2", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert [s["mode"] for s in report["steps"]] == ["closed", "closed", "open-poisson"]
    for step in report["steps"]:
        assert step["ok"] > 0 and step["errors"] == {} and step["latency_ms"]["p99"] > 0
        assert step["server"]["batches"] > 0 and step["server"]["mean_compute_ms_per_batch"] > 0
        assert step["server"]["server_latency"]["200"]["count"] == step["ok"]  # the server's own view, by status code
    bad = CliRunner().invoke(cli_app, ["loadtest", server.url, "--model", "nope", "--concurrency", "1", "--duration", "0.2"])
    assert bad.exit_code == 2 and "no model 'nope'" in bad.output


@pytest.mark.slow
def test_package_cli(onnx_model, tmp_path):
    out = tmp_path / "pkg"
    r = CliRunner().invoke(cli_app, ["package", str(onnx_model), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert {p.name for p in out.iterdir()} >= {"model", "manifest.json", "requirements.txt", "Dockerfile", "footprint.json"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["spec"]["class_names"] == LABELS and manifest["serve"]["max_batch"] == 32
    assert manifest["runtime"] == "onnxruntime" and "onnxruntime==" in " ".join(manifest["requirements"])
    reqs = (out / "requirements.txt").read_text()
    assert "onnxruntime==" in reqs and "torch" not in reqs.replace("no torch", "")
    wheel = next((out / "wheels").glob("servopt-*.whl"))  # servopt is not on an index: its wheel travels along
    assert f"./wheels/{wheel.name}" in reqs and "COPY wheels/ wheels/" in (out / "Dockerfile").read_text()
    fp = json.loads((out / "footprint.json").read_text())
    assert fp["pytorch_env"]["installed_mb"] > fp["serving_env"]["installed_mb"] > 0
    assert json.loads((out / "Dockerfile").read_text().split("CMD ")[1]) == ["servopt", "serve", ".", "--host", "0.0.0.0", "--port", "8000"]
    # The package serves from its manifest alone: runtime, options, spec and batching settings come from it.
    from starlette.testclient import TestClient

    from servopt.serve.model import from_package

    model, packaged = from_package(out)
    assert packaged["max_batch"] == 32 and model.spec.class_names == LABELS
    with TestClient(create_app({model.name: model})) as client:
        body = {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}]}
        assert client.post(f"/v2/models/{model.name}/infer", json=body).status_code == 200


def test_serving_never_imports_torch(onnx_model):
    """Serving runs with torch made unimportable, and nothing on the path imports it."""
    assert_runs_without("torch", f"""
from starlette.testclient import TestClient
from servopt.serve.rest import create_app
from servopt.serve.model import from_file
from servopt.settings import ServeSettings
app = create_app({{"tiny": from_file(__import__("pathlib").Path({str(onnx_model)!r}), "tiny")}})
with TestClient(app) as c:
    body = {{"inputs": [{{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}}]}}
    assert c.post("/v2/models/tiny/infer", json=body).status_code == 200
import servopt.cli  # the CLI, serve and loadtest commands included
""")


def test_serve_cli_passes_the_text_batching_settings(onnx_model, monkeypatch):
    """--max-call-tokens and --max-padding reach the server's settings; a negative share is refused naming the flag."""
    import servopt.serve.server

    seen = []
    monkeypatch.setattr(servopt.serve.server, "run_server", lambda models, settings: seen.append(settings))
    r = CliRunner().invoke(cli_app, ["serve", str(onnx_model), "--max-padding", "0.1", "--max-call-tokens", "256"])
    assert r.exit_code == 0, r.output
    assert seen[0].max_padding == 0.1 and seen[0].max_call_tokens == 256
    r = CliRunner().invoke(cli_app, ["serve", str(onnx_model), "--max-padding", "-1"])
    assert r.exit_code == 2 and "--max-padding" in r.output and not seen[1:]


def test_serve_cli_refuses_non_servable(tmp_path):
    path = tmp_path / "m.pt"
    torch.save(TinyNet.build().state_dict(), path)
    r = CliRunner().invoke(cli_app, ["serve", str(path)])
    assert r.exit_code == 2 and "no pickles" in r.output


@pytest.mark.slow  # over a second: `make test` runs it
def test_graceful_shutdown_finishes_in_flight_requests(onnx_model):
    s = LiveServer(onnx_model, ServeSettings(max_batch=4, max_delay_us=0))
    s.__enter__()
    session = s.app.state.plane.models["tiny"].sessions[0]
    fast_run = session.run

    def slow_run(feed):
        time.sleep(1.0)
        return fast_run(feed)

    session.run = slow_run  # the batcher calls session.run at call time
    body = {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}]}
    result = {}
    t = threading.Thread(target=lambda: result.update(r=httpx.post(f"{s.url}/v2/models/tiny/infer", json=body, timeout=30)))
    t.start()
    time.sleep(0.4)  # the request is inside the model call now
    s.server.should_exit = True  # what SIGTERM does
    t.join(timeout=30)
    s.thread.join(timeout=30)
    assert result["r"].status_code == 200 and len(result["r"].json()["outputs"][0]["data"]) == 3
    assert not s.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"{s.url}/v2/models/tiny/infer", json=body, timeout=5)


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_instance_defaults_follow_the_target_objective(onnx_model, cores, monkeypatch):
    from servopt.serve import model as served

    monkeypatch.setattr(served, "usable_cores", lambda: cores)  # every branch, whatever this machine has
    throughput = from_file(onnx_model, "t")
    throughput.objective = "throughput"
    throughput.apply_instances(None, None)
    assert throughput.instances == (2 if cores >= 2 else 1)
    assert throughput.options.get("intra_op_threads") == (cores // 2 if cores >= 2 else None)
    # the split is servopt's: a lone call gets the variant as measured (every core), in one more session
    assert throughput.solo_options == ({} if cores >= 2 else None)
    latency = from_file(onnx_model, "l")
    latency.objective = "latency"
    latency.apply_instances(None, None)
    assert latency.instances == 1 and "intra_op_threads" not in latency.options and latency.solo_options is None
    explicit = from_file(onnx_model, "e")
    explicit.apply_instances(3, 1)
    assert explicit.instances == 3 and explicit.options["intra_op_threads"] == 1 and explicit.solo_options is None
    one_thread = from_file(onnx_model, "o", options={"intra_op_threads": 1})  # measured on one core: nothing to widen
    one_thread.objective = "throughput"
    one_thread.apply_instances(None, None)
    assert one_thread.solo_options is None


def test_the_server_opens_the_solo_session_and_gives_it_to_the_batcher(onnx_model, monkeypatch):
    """A throughput target's split on 2 cores: two one-thread instances plus the variant as measured, which the data
    plane hands to the batcher; it answers as the instances do. ``--threads`` set by the user: no solo session."""
    from starlette.testclient import TestClient

    from servopt.serve import model as served

    monkeypatch.setattr(served, "usable_cores", lambda: 2)
    body = {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.5] * 3072}]}
    answers = []
    for threads in (None, 1):
        model = from_file(onnx_model, "t")
        model.objective = "throughput"
        model.apply_instances(None, threads)
        with TestClient(create_app({"t": model})) as client:
            batcher = client.app.state.plane.batchers["t"]
            assert (model.solo is not None) == (batcher.solo_fn is not None) == (threads is None)
            answers.append(client.post("/v2/models/t/infer", json=body).json()["outputs"][0]["data"])
            if model.solo is not None:  # the solo session itself answers as the instances do
                feed = {"input": np.full((1, 3, 32, 32), 0.5, np.float32)}
                np.testing.assert_allclose(batcher.solo_fn(feed), model.sessions[0].run(feed), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(answers[0], answers[1], rtol=1e-5, atol=1e-6)


def test_a_lone_call_runs_on_every_core_and_calls_that_overlap_on_the_instances():
    """The solo session takes a model call only when nothing else runs, waits or arrives, and the call is long enough
    to gain from more threads; under load the instances share the cores as they were split."""
    import asyncio

    from servopt.serve.batcher import SOLO_MIN_SECONDS, DynamicBatcher, ServiceTime

    ran: list[str] = []
    gate = threading.Event()

    def fn(tag: str, hold: bool = False):
        def run(feed):
            ran.append(tag)
            if hold:
                gate.wait(10)
            return feed["x"] * 2
        return run

    async def scenario():
        short = ServiceTime()
        short.observe(1, SOLO_MIN_SECONDS / 2)
        b = DynamicBatcher([fn("i0"), fn("i1")], max_batch=1, max_delay_us=0, solo_fn=fn("solo"), service=short)
        b.start()
        x = {"x": np.ones((1, 2), np.float32)}
        await b.submit(x)
        assert ran == ["i0"], "a short call stays on an instance: sleeping threads would make it slower"
        await b.stop()
        ran.clear()
        long = ServiceTime()
        long.observe(1, SOLO_MIN_SECONDS * 10)
        b = DynamicBatcher([fn("i0", hold=True), fn("i1")], max_batch=1, max_delay_us=0, solo_fn=fn("solo", hold=True),
                           service=long)
        b.start()
        lone = asyncio.create_task(b.submit(x))
        await asyncio.sleep(0.2)
        assert ran == ["solo"]  # the server was idle
        second = asyncio.create_task(b.submit(x))  # arrives while the solo call runs: an instance takes it
        await asyncio.sleep(0.2)
        gate.set()
        outs = await asyncio.gather(lone, second)
        assert ran == ["solo", "i1"] or ran == ["solo", "i0"]
        assert all(np.array_equal(o, x["x"] * 2) for o in outs)
        assert b.service.count == 3  # the seed and both calls: the estimate follows what lone calls cost too
        await b.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_binary_tensors_with_nan_or_infinity_are_refused(server, bad):
    x = np.zeros((1, 3, 32, 32), np.float32)
    x[0, 1, 2, 3] = bad
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    r = httpx.post(f"{server.url}/v2/models/tiny/infer", content=header + x.tobytes(),
                   headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "NaN or infinity" in r.json()["error"]


def test_queue_depth_gauge_counts_waiting_samples(onnx_model):
    s = LiveServer(onnx_model, ServeSettings(max_batch=1, max_delay_us=0))
    with s:
        session = s.app.state.plane.models["tiny"].sessions[0]
        fast_run, release = session.run, threading.Event()
        session.run = lambda feed: (release.wait(10), fast_run(feed))[1]  # hold the model until released
        body = {"inputs": [{"name": "input", "shape": [2, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 6144}]}
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(httpx.post, f"{s.url}/v2/models/tiny/infer", json=body, timeout=30)
            time.sleep(0.3)  # the first request is inside the model now
            second = pool.submit(httpx.post, f"{s.url}/v2/models/tiny/infer", json=body, timeout=30)
            time.sleep(0.3)  # the second waits in the queue: 2 samples
            depth = _metric(s.url, "servopt_queue_depth")
            release.set()
            assert first.result().status_code == second.result().status_code == 200
        assert depth == 2.0
        assert _metric(s.url, "servopt_queue_depth") == 0.0


def test_a_torch_variant_serves_only_sources_that_load_without_unpickling():
    from servopt.contracts import Artifact, ModelRef
    from servopt.runtimes.base import get_runtime
    from servopt.spec import image_classifier_spec

    torch_rt = get_runtime("torch")

    def ref(kind: str, trust: bool = False) -> Artifact:
        return Artifact(format="torch", ref=ModelRef(kind=kind, path="m", trust_pickle=trust, spec=image_classifier_spec(3)))

    assert torch_rt.servable and torch_rt.serving_refusal(ref("hf_encoder")) is None
    assert torch_rt.serving_refusal(ref("state_dict")) is None and torch_rt.serving_refusal(ref("torchscript")) is None
    assert "pickle" in torch_rt.serving_refusal(ref("pickle", trust=True))
    assert "pickle" in torch_rt.serving_refusal(ref("state_dict", trust=True))
    assert {"transformers", "safetensors"} <= set(torch_rt.serving_requirements(ref("hf_encoder")))
    assert "transformers" not in torch_rt.serving_requirements(ref("state_dict"))


def test_service_time_fits_the_cost_of_a_call():
    """The estimate admission reads: a line through calls of different sizes (fixed + per unit), the origin line when
    every call has one size, and a seed that real calls replace at once."""
    from servopt.serve.batcher import ServiceTime

    line = ServiceTime()
    for n in (1, 4, 8, 16, 32, 32, 8, 1):
        line.observe(n, 0.005 + 0.003 * n)
    fixed, per_unit = line.line()
    assert fixed == pytest.approx(0.005, rel=1e-6) and per_unit == pytest.approx(0.003, rel=1e-6)
    assert line.seconds(64, calls=2) == pytest.approx(2 * 0.005 + 64 * 0.003, rel=1e-6)

    full = ServiceTime()
    for _ in range(5):
        full.observe(32, 0.2)
    assert full.line() == (0.0, pytest.approx(0.2 / 32)) and full.seconds(256, calls=8) == pytest.approx(1.6)

    seeded = ServiceTime()
    seeded.observe(1, 0.02)  # the seed: one sample alone, 20 ms (read as 20 ms a sample: 640 ms for 32)
    assert seeded.seconds(32) == pytest.approx(0.64)
    for _ in range(3):
        seeded.observe(32, 0.32)  # then real batches: 10 ms a sample
    assert seeded.seconds(32) == pytest.approx(0.32)
    assert ServiceTime().seconds(100) == 0.0 and ServiceTime().line() is None


def test_expected_wait_counts_the_call_in_flight_and_the_queued_calls():
    """Without a server: one instance busy with a call estimated at 100 ms of which 40 ms have run, 40 samples queued at
    10 ms each in batches of 32 (2 calls of 5 ms fixed): 60 + 400 + 10 ms."""
    from servopt.serve.batcher import DynamicBatcher, Overloaded, ServiceTime, _Pending

    service = ServiceTime()
    for n in (1, 32):
        service.observe(n, 0.005 + 0.010 * n)
    b = DynamicBatcher([lambda feed: feed["x"]], max_batch=32, max_queue=256, latency_budget_s=1.0, service=service)
    assert b.expected_wait(now=0.0) == 0.0  # an idle instance and nothing queued
    b._running[0] = (9, 1, 0.0)  # a call of 9 units: 95 ms estimated, started at t=0
    for _ in range(40):
        b.queue.append(_Pending({"x": np.zeros((1, 1))}, 1, None))  # type: ignore[arg-type]
        b.queued_samples += 1
        b.queued_units += 1
    assert b.expected_wait(now=0.040) == pytest.approx((0.095 - 0.040) + 2 * 0.005 + 40 * 0.010)
    b._running[0] = (9, 1, time.perf_counter())  # the same call, starting now: 95 + 410 ms
    b.budget = 0.5  # 80 % of it is 400 ms: a ~505 ms wait is refused, and says when to come back
    with pytest.raises(Overloaded, match=r"would wait about 50\d ms; the latency budget is 500 ms") as e:
        b.admit(1)
    assert e.value.kind == "expected_wait" and e.value.retry_after == pytest.approx(0.105, abs=0.01)
    b.budget = 1.0
    b.admit(1)  # 505 ms is within 80 % of a second


def test_a_failed_metrics_push_is_counted_not_swallowed():
    """A Ray Serve replica whose snapshot cannot reach the hub keeps serving, and says so in its own metrics."""
    import asyncio

    from servopt.serve.metrics import Metrics
    from servopt.serve.ray_serve import MetricsPusher

    class Replica:
        plane = type("Plane", (), {"metrics": Metrics()})()

        async def push(self) -> None:
            raise ConnectionError("hub restarting")

    async def two_rounds() -> None:
        pusher = MetricsPusher(Replica(), interval_s=0.01)
        await pusher.start()
        await asyncio.sleep(0.05)
        await pusher.stop()

    asyncio.run(two_rounds())
    assert Replica.plane.metrics.push_errors._value.get() >= 2


@pytest.mark.skipif(not Path("/proc/thread-self/comm").exists(), reason="Linux only: thread names and per-thread niceness")
def test_inference_threads_carry_their_name_to_the_os_and_run_below_the_event_loop():
    """serve_cpu.py splits a server's CPU by thread name (inference vs event loop); py-spy and top -H show it too."""
    from servopt.serve.batcher import INFERENCE_NICENESS, DynamicBatcher

    seen: list[tuple[str, int]] = []

    def run(feed):
        seen.append((Path("/proc/thread-self/comm").read_text().strip(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return feed["x"]

    async def scenario():
        b = DynamicBatcher([run], max_batch=1, max_delay_us=0)
        b.start()
        await b.submit({"x": np.ones((1, 2), np.float32)})
        await b.stop()

    loop_niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    asyncio.run(scenario())
    name, niceness = seen[0]
    assert name == "servopt-infer_0"
    # setpriority sets an absolute niceness; a process already nicer than that (unprivileged) keeps its own
    assert niceness == INFERENCE_NICENESS or (loop_niceness > INFERENCE_NICENESS and niceness == loop_niceness)
    assert Path("/proc/thread-self/comm").read_text().strip() != "servopt-infer_0"  # the caller's own name is untouched


def test_a_refusal_sent_to_a_client_names_files_not_server_paths():
    """Whatever a family or loader writes into a UserError, the data plane cuts absolute paths to file names before
    a client reads it; ratios, "and/or" and URLs stay as written."""
    from servopt.errors import UserError
    from servopt.serve.dataplane import client_message

    e = UserError("input_ids holds 12 (from /srv/models/enc/config.json and '/home/me/tok/tokenizer.json'), mask 0/1",
                  fix="see https://example.org/docs/x and/or /srv/models/")
    text = client_message(e)
    assert text == "input_ids holds 12 (from config.json and 'tokenizer.json'), mask 0/1 (see https://example.org/docs/x and/or )"


def _chunked_upload(port: int, headers: str, total: int, chunk: int = 16384, wait_s: float = 10.0) -> tuple[bytes, int]:
    """A raw-socket client that reads while it sends (http.client would send the whole body first): headers, then a
    chunked body of up to ``total`` bytes, never terminated. Returns (what the server answered, bytes sent)."""
    import socket

    conn = socket.create_connection(("127.0.0.1", port), timeout=wait_s)
    answer = bytearray()
    done = threading.Event()

    def read() -> None:
        try:
            while data := conn.recv(65536):
                answer.extend(data)
                if b"\r\n\r\n" in answer:
                    head, _, rest = bytes(answer).partition(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), None)
                    if length is not None and len(rest) >= length:
                        break
        except OSError:
            pass
        finally:
            done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = 0
    try:
        conn.sendall(headers.encode())
        piece = f"{chunk:x}\r\n".encode() + b"7" * chunk + b"\r\n"
        while sent < total and not done.is_set():
            conn.sendall(piece)
            sent += chunk
    except OSError:  # the server closed the connection while the client was still writing: what the cap does
        pass
    done.wait(wait_s)
    conn.close()
    return bytes(answer), sent


@pytest.mark.parametrize("refusal", ["bad token", "overloaded"])
def test_a_chunked_body_refused_at_its_headers_is_not_read_past_the_cap(onnx_model, refusal):
    """A chunked upload refused before its body (401 bad token, 503 overloaded) was drained to its end, however
    long: an unauthenticated client could stream without bound. Now at most --max-body-mb is read, then the refusal
    is answered with Connection: close. The client below sends 8 MB against a 64 KB cap and never ends its body:
    without the cap the server would read on and never answer."""
    from servopt.serve.protocol import BadRequest, Reason

    cap = 65536
    with LiveServer(onnx_model, ServeSettings(api_key="s3cret", max_body_mb=cap / 2**20)) as s:
        token = "wrong" if refusal == "bad token" else "s3cret"
        if refusal == "overloaded":
            def admit(model: str) -> None:
                raise BadRequest("overloaded: the queue is full; retry later", Reason.OVERLOADED, retry_after=1)

            s.plane.admit = admit
        headers = (f"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                   "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        answer, sent = _chunked_upload(s.port, headers, total=8 * 2**20)
        status = 401 if refusal == "bad token" else 503
        assert answer.startswith(f"HTTP/1.1 {status}".encode()), (answer[:200], sent)
        assert b"connection: close" in answer.lower()
        assert sent < 8 * 2**20  # refused and closed long before the client finished
        small = httpx.post(f"{s.url}/v2/models/tiny/infer", content=iter([b"{}"]),
                           headers={"Authorization": f"Bearer {token}"})
        assert small.status_code == status and small.headers.get("connection") != "close"  # under the cap: drained, kept alive
