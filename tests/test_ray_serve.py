"""Serving on Ray Serve (``servopt serve --ray``): the same app, errors and batching from two replicas, /metrics summed
over them, the CLI, and a clean error (and no Ray import) where Ray is not installed.

The Ray tests share one local Ray instance (2 CPUs, no dashboard) for the module, shut down at the end; HOME and TMPDIR
point into the test sandbox (conftest), so Ray's session folder and auth token stay out of the real home."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import assert_runs_without, free_port, tiny_classifier_onnx
from servopt.cli import app as cli_app
from servopt.errors import UserError
from servopt.serve.metrics import Metrics
from servopt.serve.model import from_file
from servopt.serve.ray_serve import MetricsHub, deployment_options, exposition_of, merge, parse_autoscale, snapshot
from servopt.settings import ServeSettings
from test_serve import LABELS, LiveServer, _bad_requests, _metric, direct

SETTINGS = {"max_batch": 16, "max_delay_us": 20_000, "max_body_mb": 1.0, "max_image_pixels": 1_000_000}  # test_serve's server
INFER_OK = 'servopt_requests_total{code="200",endpoint="v2/models/{name}/infer"}'


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory) -> Path:
    return tiny_classifier_onnx(tmp_path_factory.mktemp("ray") / "tiny.onnx", LABELS)


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, namespace="servopt-tests", logging_level="WARNING")
    yield ray
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_server(ray_instance, onnx_model):
    """``run_ray_server`` (the CLI's code path) with two replicas, in a thread until the module is done."""
    from servopt.serve.ray_serve import run_ray_server

    settings = ServeSettings(port=free_port(), **SETTINGS)
    ready, stop, failed = threading.Event(), threading.Event(), []

    def run() -> None:
        try:
            run_ray_server({"tiny": from_file(onnx_model, "tiny")}, settings, replicas=2, on_ready=ready.set, stop=stop)
        except BaseException as e:  # noqa: BLE001 - reported to the fixture, which fails with it
            failed.append(e)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(180) and not failed, failed
    yield f"http://127.0.0.1:{settings.port}"
    stop.set()
    thread.join(timeout=60)


@pytest.fixture(scope="module")
def local_server(onnx_model):
    """The single-process server with the same settings: what the Ray one must answer alike."""
    with LiveServer(onnx_model, ServeSettings(**SETTINGS)) as s:
        yield s.url


@pytest.mark.slow
@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_on_ray(ray_server, onnx_model, binary):
    import tritonclient.http as tc

    client = tc.InferenceServerClient(url=ray_server.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    assert client.get_model_metadata("tiny")["inputs"][0] == {"name": "input", "datatype": "FP32", "shape": [-1, 3, 32, 32]}
    assert client.get_model_config("tiny")["max_batch_size"] == 16
    x = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    inp = tc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    result = client.infer("tiny", [inp], outputs=[tc.InferRequestedOutput("logits", binary_data=binary)])
    np.testing.assert_allclose(result.as_numpy("logits"), direct(onnx_model, x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("route", "kwargs", "status", "message"), _bad_requests())
def test_bad_requests_answer_as_the_single_process_server(ray_server, local_server, route, kwargs, status, message):
    ray = httpx.post(f"{ray_server}/v2/models/tiny/{route}", **kwargs)
    local = httpx.post(f"{local_server}/v2/models/tiny/{route}", **kwargs)
    assert (ray.status_code, ray.json()) == (local.status_code, local.json())
    assert ray.status_code == status and message in ray.json()["error"]


@pytest.mark.slow
def test_unknown_model_and_route_on_ray(ray_server, local_server):
    for method, path in (("POST", "/v2/models/nope/infer"), ("GET", "/v2/nothing"), ("GET", "/v2/models/nope")):
        ray, local = httpx.request(method, ray_server + path, json={"inputs": []}), httpx.request(method, local_server + path, json={"inputs": []})
        assert (ray.status_code, ray.json()) == (local.status_code, local.json()), path


@pytest.mark.slow
def test_both_replicas_serve(ray_server):
    seen = {httpx.get(f"{ray_server}/v2/models/tiny").headers["servopt-replica"] for _ in range(40)}
    assert len(seen) == 2, seen


@pytest.mark.slow
def test_batching_and_metrics_summed_over_replicas(ray_server, onnx_model):
    time.sleep(2.5)  # every replica has pushed its figures since the last request: the baseline is exact
    before = {name: _metric(ray_server, name) for name in (INFER_OK, "servopt_batch_size_count", "servopt_ray_replicas")}
    assert before["servopt_ray_replicas"] == 2
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((1 + i % 2, 3, 32, 32)).astype(np.float32) for i in range(24)]

    def call(x: np.ndarray) -> tuple[np.ndarray, str]:
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]}
        r = httpx.post(f"{ray_server}/v2/models/tiny/infer", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(len(x), 3), r.headers["servopt-replica"]

    with ThreadPoolExecutor(max_workers=24) as pool:
        answers = list(pool.map(call, xs))
    for x, (got, _) in zip(xs, answers, strict=True):  # each answer went to its own caller, from whichever replica
        np.testing.assert_allclose(got, direct(onnx_model, x), rtol=1e-4, atol=1e-5)
    replicas = {replica for _, replica in answers}
    deadline = time.time() + 15
    while _metric(ray_server, INFER_OK) < before[INFER_OK] + len(xs) and time.time() < deadline:
        time.sleep(0.3)  # the replica that did not answer /metrics pushes its share within a second
    assert _metric(ray_server, INFER_OK) == before[INFER_OK] + len(xs)  # every request counted once, whoever served it
    batches = _metric(ray_server, "servopt_batch_size_count") - before["servopt_batch_size_count"]
    assert batches < len(xs), f"requests must share model calls on each replica ({batches} batches, replicas {replicas})"
    text = httpx.get(f"{ray_server}/metrics").text
    assert "servopt_queue_seconds_bucket" in text and "servopt_queue_depth 0.0" in text and "servopt_ray_replicas 2.0" in text


# without a Ray cluster ---------------------------------------------------------------------------------------------
def test_merge_sums_replicas_and_keeps_what_left():
    a, b = Metrics(), Metrics()
    for m, n in ((a, 3), (b, 2)):
        for _ in range(n):
            m.observe_request("v2/models/{name}/infer", 200, 0.003)
        m.batch.observe(n)
    a.depth.set(4)
    b.depth.set(1)
    live = merge([(snapshot(a.registry), True), (snapshot(b.registry), True)])
    text = exposition_of(live, 2).decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples[INFER_OK]) == 5 and float(samples["servopt_batch_size_count"]) == 2
    assert float(samples["servopt_batch_size_sum"]) == 5 and float(samples['servopt_batch_size_bucket{le="2.0"}']) == 1
    assert float(samples["servopt_queue_depth"]) == 5 and float(samples["servopt_ray_replicas"]) == 2
    created = [snapshot(m.registry)[0][3] for m in (a, b)]  # the earliest creation time, not a sum of timestamps
    assert float(samples['servopt_requests_created{code="200",endpoint="v2/models/{name}/infer"}']) == min(
        next(v for s, _, v in c if s.endswith("_created")) for c in created)

    hub = MetricsHub(stale_after_s=10)

    async def scenario() -> dict[str, float]:
        await hub.push("a", snapshot(a.registry))
        await hub.push("b", snapshot(b.registry))
        await hub.push("b", snapshot(b.registry), final=True)  # b scaled down: its requests stay counted, its queue not
        text = (await hub.exposition()).decode()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}

    after = asyncio.run(scenario())
    assert after[INFER_OK] == 5 and after["servopt_queue_depth"] == 4 and after["servopt_ray_replicas"] == 1
    assert hub.replicas.keys() == {"a"}


def test_replicas_and_autoscaling_options(onnx_model):
    models = {"tiny": from_file(onnx_model, "tiny")}
    settings = ServeSettings(max_queue=64, max_batch=8)
    fixed = deployment_options(models, settings, replicas=3)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] >= 64 + 8  # the replica's own queue refuses (503), not Ray's router
    scale = parse_autoscale("1-4", settings.max_batch)
    assert scale == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0}
    assert parse_autoscale("0-2:3", 8)["target_ongoing_requests"] == 3.0
    auto = deployment_options(models, settings, autoscale=scale)
    assert auto["autoscaling_config"] == scale and "num_replicas" not in auto
    for bad in ("4", "3-1", "a-b", "1-4:0", "0-0"):
        with pytest.raises(UserError, match="MIN-MAX"):
            parse_autoscale(bad, 8)


@pytest.mark.slow  # a whole CLI run in job processes: `make test` runs it
def test_serve_cli_on_ray(onnx_model, monkeypatch):
    pytest.importorskip("ray")
    import servopt.serve.ray_serve as rs

    calls = []
    monkeypatch.setattr(rs, "run_ray_server", lambda models, settings, **kw: calls.append((models, settings, kw)))
    r = CliRunner().invoke(cli_app, ["serve", str(onnx_model), "--name", "tiny", "--ray", "--replicas", "2", "--port", "8123"])
    assert r.exit_code == 0, r.output
    models, settings, kw = calls[-1]
    assert list(models) == ["tiny"] and settings.port == 8123 and kw == {"replicas": 2, "autoscale": None, "address": None}
    assert "Ray Serve (2 replica(s), local Ray)" in r.output
    r = CliRunner().invoke(cli_app, ["serve", str(onnx_model), "--ray-address", "auto", "--autoscale", "1-3", "--max-batch", "4"])
    assert r.exit_code == 0, r.output
    assert calls[-1][2] == {"replicas": 1, "autoscale": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4.0},
                            "address": "auto"}
    for args, message in ((["--replicas", "2"], "add --ray"), (["--ray", "--grpc-port", "9001"], "--grpc-port is not served"),
                          (["--ray", "--replicas", "2", "--autoscale", "1-2"], "exclude each other"),
                          (["--ray", "--autoscale", "2"], "MIN-MAX")):
        r = CliRunner().invoke(cli_app, ["serve", str(onnx_model), *args])
        assert r.exit_code == 2 and message in r.output, (args, r.output)


def test_without_ray_nothing_imports_it_and_ray_is_a_clear_error(onnx_model):
    """With Ray made unimportable: the CLI and the Ray module import, nothing imports Ray, and --ray names the extra."""
    assert_runs_without("ray", f"""
import servopt.cli
import servopt.serve.ray_serve
from typer.testing import CliRunner
r = CliRunner().invoke(servopt.cli.app, ["serve", {str(onnx_model)!r}, "--ray", "--replicas", "2"])
assert r.exit_code == 2, r.output
assert "pip install 'servopt[ray]'" in r.output, r.output
""", cwd=Path(__file__).parent)
