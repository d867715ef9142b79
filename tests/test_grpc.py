"""The gRPC front end (OIP v2 ``inference.GRPCInferenceService``) on a free loopback port, with REST on the same data
plane: tritonclient.grpc, bad requests, overload, auth, one batcher for both front ends, the CLI, lean imports, and
the generated code against the .proto and against tritonclient's own field numbers."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import pytest

from conftest import LiveServer, assert_runs_without, tiny_classifier_onnx
from servopt.serve.proto import grpc_service_pb2 as pb
from servopt.settings import ServeSettings

LABELS = ["cat", "dog", "fish"]
SHAPE = [1, 3, 32, 32]


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory) -> Path:
    """The tiny image classifier of test_serve (servopt metadata: labels, preprocessing)."""
    return tiny_classifier_onnx(tmp_path_factory.mktemp("grpc") / "tiny.onnx", LABELS)


def direct(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


@pytest.fixture(scope="module")
def stack(onnx_model):
    settings = ServeSettings(max_batch=16, max_delay_us=20_000, max_body_mb=1.0)
    with LiveServer(onnx_model, settings, grpc=True, parameters={"variant": "ort-fp32", "rank": 1}) as s:
        yield s


def request(x: np.ndarray | None = None, **fields) -> pb.ModelInferRequest:
    """A ModelInferRequest for the tiny model, raw contents; ``fields`` override."""
    x = np.zeros(SHAPE, np.float32) if x is None else x
    base = {"model_name": "tiny", "inputs": [pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=x.shape)],
            "raw_input_contents": [x.tobytes()]}
    return pb.ModelInferRequest(**{**base, **fields})


def tensor(**fields) -> pb.ModelInferRequest.InferInputTensor:
    return pb.ModelInferRequest.InferInputTensor(**{"name": "input", "datatype": "FP32", "shape": SHAPE, **fields})


# --- health, metadata, config ------------------------------------------------------------------------------------------

def test_health_and_metadata_through_tritonclient(stack):
    client = stack.triton()
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "servopt" and "model_configuration" in server["extensions"]
    meta = client.get_model_metadata("tiny", as_json=True)
    assert meta["platform"] == "onnxruntime_onnx" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "3", "32", "32"]}]  # int64 → JSON text
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": ["-1", "3"]}]
    config = client.get_model_config("tiny", as_json=True)["config"]
    assert config["max_batch_size"] == 16 and config["platform"] == "onnxruntime_onnx"
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": ["3", "32", "32"]}]
    assert config["output"] == [{"name": "logits", "data_type": "TYPE_FP32", "dims": ["3"]}]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "20000"
    assert config["instance_group"] == [{"count": 1, "kind": "KIND_CPU"}]
    assert config["parameters"]["variant"] == {"string_value": "ort-fp32"}
    # The protocol's optional model properties (field 6, not in Triton's .proto) carry the model's parameters.
    properties = stack.stub.ModelMetadata(pb.ModelMetadataRequest(name="tiny")).properties
    assert dict(properties) == {"variant": "ort-fp32", "rank": "1"}


# --- inference --------------------------------------------------------------------------------------------------------

def test_tritonclient_infer_matches_onnxruntime_and_rest(stack, onnx_model):
    import tritonclient.grpc as tc
    import tritonclient.http as th

    x = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    inp = tc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = stack.triton().infer("tiny", [inp], outputs=[tc.InferRequestedOutput("logits")], request_id="r-7")
    got = result.as_numpy("logits")
    assert result.get_response().id == "r-7" and result.get_response().model_version == "1"
    np.testing.assert_allclose(got, direct(onnx_model, x), rtol=1e-4, atol=1e-5)

    rest_in = th.InferInput("input", list(x.shape), "FP32")
    rest_in.set_data_from_numpy(x)
    rest = th.InferenceServerClient(url=f"127.0.0.1:{stack.port}").infer("tiny", [rest_in]).as_numpy("logits")
    np.testing.assert_allclose(got, rest, rtol=1e-5, atol=1e-6)


def test_typed_contents_give_the_same_answer(stack, onnx_model):
    x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    contents = pb.InferTensorContents(fp32_contents=x.reshape(-1))
    r = stack.stub.ModelInfer(pb.ModelInferRequest(model_name="tiny", model_version="1", inputs=[tensor(contents=contents)]))
    assert r.outputs[0].name == "logits" and list(r.outputs[0].shape) == [1, 3] and r.outputs[0].datatype == "FP32"
    got = np.frombuffer(r.raw_output_contents[0], np.float32).reshape(1, 3)
    np.testing.assert_allclose(got, direct(onnx_model, x), rtol=1e-4, atol=1e-5)


# --- bad requests -----------------------------------------------------------------------------------------------------

def _nan() -> np.ndarray:
    x = np.zeros(SHAPE, np.float32)
    x[0, 1, 2, 3] = np.nan
    return x


INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
BAD_REQUESTS = {
    "wrong datatype": (request(inputs=[tensor(datatype="INT64")], raw_input_contents=[bytes(8 * 3072)]), INVALID, "model expects FP32"),
    "wrong shape": (request(np.zeros((1, 3, 16, 16), np.float32)), INVALID, "model expects [-1, 3, 32, 32]"),
    "unknown input": (request(inputs=[tensor(name="pixels")]), INVALID, "unknown input 'pixels'"),
    "NaN": (request(_nan()), INVALID, "NaN or infinity"),
    "raw contents of the wrong size": (request(raw_input_contents=[bytes(100)]), INVALID, "raw_input_contents[0] of 100 bytes does not match"),
    "missing input": (pb.ModelInferRequest(model_name="tiny"), INVALID, "missing input(s) ['input']"),
    "wrong number of raw contents": (request(raw_input_contents=[bytes(12288)] * 2), INVALID, "2 raw_input_contents for 1 inputs"),
    "unsupported datatype": (request(inputs=[tensor(datatype="COMPLEX")]), INVALID, "not supported"),
    "negative dimension": (request(inputs=[tensor(shape=[-1, 3, 32, 32])]), INVALID, "negative dimension"),
    "zero batch": (request(inputs=[tensor(shape=[0, 3, 32, 32])], raw_input_contents=[b""]), INVALID, "at least 1"),
    "no data": (pb.ModelInferRequest(model_name="tiny", inputs=[tensor()]), INVALID, "has no data"),
    "contents and raw": (request(inputs=[tensor(contents=pb.InferTensorContents(fp32_contents=[0.0]))]), INVALID, "one or the other"),
    "contents in the wrong field": (pb.ModelInferRequest(model_name="tiny", inputs=[tensor(contents=pb.InferTensorContents(
        int64_contents=[0] * 3072))]), INVALID, "goes in contents.fp32_contents"),
    "too few typed elements": (pb.ModelInferRequest(model_name="tiny", inputs=[tensor(contents=pb.InferTensorContents(
        fp32_contents=[0.0] * 10))]), INVALID, "10 elements given"),
    "FP16 as typed contents": (pb.ModelInferRequest(model_name="tiny", inputs=[tensor(datatype="FP16", contents=pb.InferTensorContents(
        fp32_contents=[0.0] * 3072))]), INVALID, "no typed contents field"),
    "INT8 out of range": (pb.ModelInferRequest(model_name="tiny", inputs=[tensor(datatype="INT8", contents=pb.InferTensorContents(
        int_contents=[300] * 3072))]), INVALID, "outside INT8's range"),
    "truncated BYTES": (request(inputs=[tensor(datatype="BYTES", shape=[2])], raw_input_contents=[b"\x05\x00\x00\x00ab"]),
                        INVALID, "runs past the data"),
    "unknown output": (request(outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="probs")]), INVALID, "unknown output"),
    "unknown model": (request(model_name="nope"), NOT_FOUND, "unknown model 'nope'"),
    "unknown version": (request(model_version="7"), NOT_FOUND, "no version '7'"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_a_clear_status(stack, case):
    message, code, words = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as e:
        stack.stub.ModelInfer(message, timeout=10)
    assert e.value.code() == code, (e.value.code(), e.value.details())
    assert words in e.value.details()


def test_undecodable_and_oversized_messages_are_client_errors(stack):
    raw = stack.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\xff\xff\xff\xff", timeout=10)
    assert e.value.code() == INVALID and "not a valid ModelInferRequest" in e.value.details()
    too_big = request(np.zeros((100, 3, 32, 32), np.float32))  # 1.2 MB over the 1 MB limit
    with pytest.raises(grpc.RpcError) as e:
        stack.stub.ModelInfer(too_big, timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stack.stub.ServerReady(pb.ServerReadyRequest()).ready


def test_tritonclient_sees_invalid_argument_and_metrics_stay_bounded(stack):
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException

    inp = tc.InferInput("input", SHAPE, "FP64")
    inp.set_data_from_numpy(np.zeros(SHAPE, np.float64))
    with pytest.raises(InferenceServerException) as e:
        stack.triton().infer("tiny", [inp])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "model expects FP32" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        stack.triton().get_model_metadata("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    text = httpx.get(f"{stack.url}/metrics").text
    grpc_labels = {(line.split('endpoint="')[1].split('"')[0], line.split('code="')[1].split('"')[0])
                   for line in text.splitlines() if line.startswith("servopt_requests_total{") and 'endpoint="grpc/' in line}
    assert ("grpc/ModelInfer", "INVALID_ARGUMENT") in grpc_labels and ("grpc/ModelInfer", "OK") in grpc_labels
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    assert {endpoint for endpoint, _ in grpc_labels} <= {f"grpc/{m}" for m in methods}
    assert not {code for _, code in grpc_labels} & {"INTERNAL", "UNKNOWN"}, grpc_labels


def test_too_many_samples_and_a_full_queue_are_resource_exhausted(onnx_model):
    """More samples than the queue holds: RESOURCE_EXHAUSTED naming the limit, no retry-after (a smaller request is the
    fix). A full queue: RESOURCE_EXHAUSTED saying so, with retry-after. Then it serves again."""
    with LiveServer(onnx_model, ServeSettings(max_batch=1, max_delay_us=0, max_queue=2), grpc=True) as s:
        with pytest.raises(grpc.RpcError) as e:
            s.stub.ModelInfer(request(np.zeros((8, 3, 32, 32), np.float32)), timeout=10)  # 8 samples > the queue's 2
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "the queue holds at most 2" in e.value.details()
        assert "retry-after" not in dict(e.value.trailing_metadata())
        s.estimate(0.001)
        held = s.hold()
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(s.stub.ModelInfer, request(), timeout=30)
            held.wait_for_calls(1)
            queued = pool.submit(s.stub.ModelInfer, request(np.zeros((2, 3, 32, 32), np.float32)), timeout=30)
            deadline = time.time() + 10
            while s.batcher().depth < 2 and time.time() < deadline:
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as e:
                s.stub.ModelInfer(request(), timeout=10)
            held.release()
            assert len(first.result().raw_output_contents[0]) == 12 and len(queued.result().raw_output_contents[0]) == 24
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "the queue is full" in e.value.details()
        assert ("retry-after", "1") in tuple(e.value.trailing_metadata())
        assert s.metric('servopt_refused_total{reason="queue_full"}') == 1
        assert len(s.stub.ModelInfer(request(), timeout=10).raw_output_contents[0]) == 12


def test_over_the_latency_budget_is_resource_exhausted_with_retry_after(onnx_model):
    """Admission by expected wait on gRPC: refused before the tensors are decoded when the wait would pass the budget;
    dropped when a queued call has waited past it. Both RESOURCE_EXHAUSTED with a message saying why."""
    with LiveServer(onnx_model, ServeSettings(max_batch=1, max_delay_us=0, latency_budget_ms=200), grpc=True) as s:
        s.estimate(0.001)
        held = s.hold()
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(s.stub.ModelInfer, request(), timeout=30)
            held.wait_for_calls(1)
            late = pool.submit(s.stub.ModelInfer, request(), timeout=30)
            deadline = time.time() + 10
            while s.batcher().depth < 1 and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # the queued call is past the 200 ms budget now
            s.estimate(60.0)  # the model is now estimated at a minute a call
            with pytest.raises(grpc.RpcError) as refused:
                s.stub.ModelInfer(request(), timeout=10)
            held.release()
            assert len(first.result().raw_output_contents[0]) == 12
            with pytest.raises(grpc.RpcError) as dropped:
                late.result()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "latency budget is 200 ms" in refused.value.details()
        assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 30
        assert dropped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "dropped after waiting" in dropped.value.details()
        assert held.calls == [1]
        assert s.metric('servopt_refused_total{reason="expected_wait"}') == 1 and s.metric("servopt_dropped_total") == 1


def test_bearer_token(onnx_model):
    from tritonclient.utils import InferenceServerException

    with LiveServer(onnx_model, ServeSettings(api_key="s3cret"), grpc=True) as s:
        client = s.triton()
        assert client.is_server_live() and client.is_server_ready()  # health needs no token
        with pytest.raises(InferenceServerException) as e:
            client.get_model_metadata("tiny")
        assert e.value.status() == "StatusCode.UNAUTHENTICATED" and "bearer token" in e.value.message()
        with pytest.raises(InferenceServerException) as e:
            client.is_model_ready("tiny", headers={"authorization": "Bearer wrong"})
        assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        good = {"authorization": "Bearer s3cret"}
        assert client.get_model_metadata("tiny", headers=good).name == "tiny"
        with pytest.raises(grpc.RpcError) as e:  # checked before the body is even parsed
            s.stub.ModelInfer(request(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(s.stub.ModelInfer(request(), metadata=(("authorization", "Bearer s3cret"),)).outputs) == 1
        assert httpx.get(f"{s.url}/v2/models/tiny").status_code == 401  # REST: the same key, the same check
        assert httpx.get(f"{s.url}/v2/models/tiny", headers=good).status_code == 200


# --- one data plane for both front ends ----------------------------------------------------------------------------

def test_rest_and_grpc_requests_share_one_batcher(onnx_model):
    """While the model is busy, a REST and a gRPC request queue up; they are run as one batch of 2."""
    with LiveServer(onnx_model, ServeSettings(max_batch=16, max_delay_us=50_000), grpc=True) as s:
        session = s.plane.models["tiny"].sessions[0]
        fast_run, release, sizes = session.run, threading.Event(), []

        def held_run(feed):
            sizes.append(len(feed["input"]))
            release.wait(10)
            return fast_run(feed)

        session.run = held_run
        rng = np.random.default_rng(4)
        xs = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]

        def rest(x):
            body = {"inputs": [{"name": "input", "shape": SHAPE, "datatype": "FP32", "data": x.reshape(-1).tolist()}]}
            r = httpx.post(f"{s.url}/v2/models/tiny/infer", json=body, timeout=30)
            return np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(1, 3)

        def grpc_call(x):
            return np.frombuffer(s.stub.ModelInfer(request(x), timeout=30).raw_output_contents[0], np.float32).reshape(1, 3)

        with ThreadPoolExecutor(max_workers=3) as pool:
            first = pool.submit(rest, xs[0])
            while not sizes:  # the first request is inside the model
                time.sleep(0.01)
            later = [pool.submit(rest, xs[1]), pool.submit(grpc_call, xs[2])]
            deadline = time.time() + 10
            while s.plane.batchers["tiny"].depth < 2 and time.time() < deadline:
                time.sleep(0.01)
            release.set()
            answers = [first.result(), *(f.result() for f in later)]
        assert sizes == [1, 2], sizes
        for x, got in zip(xs, answers, strict=True):
            np.testing.assert_allclose(got, direct(onnx_model, x), rtol=1e-4, atol=1e-5)
        assert s.metric("servopt_batch_size_count") == 2 and s.metric("servopt_batch_size_sum") == 3


def test_concurrent_rest_and_grpc_answers_go_to_the_right_caller(stack, onnx_model):
    import tritonclient.grpc as tc

    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1 + i % 2, 3, 32, 32)).astype(np.float32) for i in range(16)]
    client = stack.triton()

    def call(i: int) -> np.ndarray:
        x = xs[i]
        if i % 2:
            inp = tc.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            return client.infer("tiny", [inp]).as_numpy("logits")
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]}
        r = httpx.post(f"{stack.url}/v2/models/tiny/infer", json=body, timeout=30)
        return np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(len(x), 3)

    before = stack.metric("servopt_batch_size_count")
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(call, range(len(xs))))
    for x, got in zip(xs, answers, strict=True):
        np.testing.assert_allclose(got, direct(onnx_model, x), rtol=1e-4, atol=1e-5)
    assert stack.metric("servopt_batch_size_count") - before < len(xs), "several requests must have shared a model call"


@pytest.mark.slow  # over a second: `make test` runs it
def test_graceful_shutdown_finishes_in_flight_grpc_calls(onnx_model):
    s = LiveServer(onnx_model, ServeSettings(max_batch=4, max_delay_us=0), grpc=True).__enter__()
    session = s.plane.models["tiny"].sessions[0]
    fast_run = session.run
    session.run = lambda feed: (time.sleep(1.0), fast_run(feed))[1]
    result = {}
    t = threading.Thread(target=lambda: result.update(r=s.stub.ModelInfer(request(), timeout=30)))
    t.start()
    time.sleep(0.4)  # the call is inside the model now
    s.server.should_exit = True  # what SIGTERM does
    t.join(timeout=30)
    s.thread.join(timeout=30)
    assert len(result["r"].raw_output_contents[0]) == 12 and not s.thread.is_alive()
    with pytest.raises(grpc.RpcError) as e:
        s.stub.ServerLive(pb.ServerLiveRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    s.channel.close()


# --- the command line, lean imports -------------------------------------------------------------------------------

@pytest.mark.slow  # over a second: `make test` runs it
def test_serve_cli_answers_tritonclient_grpc(onnx_model):
    import tritonclient.grpc as tc

    from servopt.serve.harness import ServerProcess

    server = ServerProcess(onnx_model, "--max-delay-us", "0", grpc=True)
    try:
        client = tc.InferenceServerClient(url=server.grpc_url)
        assert client.is_server_ready()
        x = np.random.default_rng(6).standard_normal((2, 3, 32, 32)).astype(np.float32)
        inp = tc.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("tiny", [inp]).as_numpy("logits"), direct(onnx_model, x), rtol=1e-4, atol=1e-5)
    finally:
        code = server.stop()
        out = server.output()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal: -SIGTERM is a clean exit here.
    assert code in (0, -signal.SIGTERM) and "Traceback" not in out, out
    assert f"gRPC on 127.0.0.1:{server.grpc_port}" in " ".join(out.split())  # rich may wrap the line


def test_serving_with_grpc_never_imports_torch(onnx_model):
    """The data plane with both front ends, torch made unimportable: nothing on the path imports it."""
    assert_runs_without("torch", f"""
import grpc, numpy as np
from starlette.testclient import TestClient
from servopt.serve.dataplane import DataPlane
from servopt.serve.grpc_server import GrpcFrontend
from servopt.serve.model import from_file
from servopt.serve.proto import grpc_service_pb2 as pb, grpc_service_pb2_grpc as pb_grpc
from servopt.serve.rest import create_app
from servopt.settings import ServeSettings
plane = DataPlane({{"tiny": from_file(__import__("pathlib").Path({str(onnx_model)!r}), "tiny")}}, ServeSettings())
frontend = GrpcFrontend(plane, "127.0.0.1", 0)
with TestClient(create_app(plane, frontends=[frontend])):
    with grpc.insecure_channel(f"127.0.0.1:{{frontend.port}}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        x = np.zeros((1, 3, 32, 32), np.float32)
        t = pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=x.shape)
        r = stub.ModelInfer(pb.ModelInferRequest(model_name="tiny", inputs=[t], raw_input_contents=[x.tobytes()]), timeout=30)
        assert len(r.raw_output_contents[0]) == 12
import servopt.cli
import tritonclient.grpc  # the stock client in the same process as the server (descriptor pools apart)
""")


# --- the generated code ----------------------------------------------------------------------------------------------

def test_generated_code_is_what_the_proto_gives(tmp_path):
    pytest.importorskip("grpc_tools")
    from servopt.serve.proto.generate import generate

    for path in generate(tmp_path):
        committed = Path(pb.__file__).with_name(path.name)
        assert path.read_text() == committed.read_text(), f"{committed.name} is stale: run python -m servopt.serve.proto.generate"


def _fields(message) -> dict:
    return {f.name: (f.number, f.type, f.is_repeated, f.message_type and f.message_type.name, f.enum_type and f.enum_type.name)
            for f in message.fields}


def test_field_numbers_match_tritonclient():
    """Every message, field and enum value of ours exists in tritonclient's grpc_service / model_config with the same
    number and type (the wire format), except ModelMetadataResponse.properties: the OIP's field that Triton lacks."""
    from tritonclient.grpc import model_config_pb2, service_pb2

    def compare(ours, theirs, path: str) -> None:
        mine, their = _fields(ours), _fields(theirs)
        for name, spec in mine.items():
            if f"{path}.{name}" == "ModelMetadataResponse.properties":
                assert "properties" not in their and spec[0] not in {s[0] for s in their.values()}
                continue
            assert their.get(name) == spec, (path, name, spec, their.get(name))
        for nested in ours.nested_types:
            if not nested.GetOptions().map_entry:
                compare(nested, theirs.nested_types_by_name[nested.name], f"{path}.{nested.name}")
        for enum in ours.enum_types:
            assert {v.name: v.number for v in enum.values}.items() <= {v.name: v.number for v in theirs.enum_types_by_name[enum.name].values}.items()

    for name, message in pb.DESCRIPTOR.message_types_by_name.items():
        theirs = service_pb2.DESCRIPTOR.message_types_by_name.get(name) or model_config_pb2.DESCRIPTOR.message_types_by_name[name]
        compare(message, theirs, name)
    ours_dt = {v.name: v.number for v in pb.DataType.DESCRIPTOR.values}
    assert ours_dt == {v.name: v.number for v in model_config_pb2.DataType.DESCRIPTOR.values}
    their_methods = {m.name: (m.input_type.name, m.output_type.name) for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        assert their_methods[m.name] == (m.input_type.name, m.output_type.name)
    assert pb.DESCRIPTOR.package == service_pb2.DESCRIPTOR.package == "inference"


# --- the codec and the status mapping, without a server -------------------------------------------------------------

def test_every_reason_has_a_status_code():
    """REST and gRPC map the same reasons, and gRPC never reads the message to choose a code."""
    from servopt.serve.grpc_server import GRPC_CODE, status_code
    from servopt.serve.protocol import HTTP_STATUS, BadRequest, Reason

    assert set(GRPC_CODE) == set(HTTP_STATUS) == set(Reason)
    expected = {Reason.INVALID: (400, "INVALID_ARGUMENT"), Reason.UNAUTHENTICATED: (401, "UNAUTHENTICATED"),
                Reason.NOT_FOUND: (404, "NOT_FOUND"), Reason.TOO_LARGE: (413, "RESOURCE_EXHAUSTED"),
                Reason.UNSUPPORTED_MEDIA: (415, "INVALID_ARGUMENT"), Reason.OVERLOADED: (503, "RESOURCE_EXHAUSTED"),
                Reason.UNAVAILABLE: (503, "UNAVAILABLE"), Reason.TIMEOUT: (504, "DEADLINE_EXCEEDED")}
    for reason, (http, code) in expected.items():
        error = BadRequest("overloaded: the words do not matter", reason)
        assert (error.status, status_code(error).name) == (http, code), reason
    assert BadRequest("x", Reason.OVERLOADED, retry_after=2.2).headers == {"Retry-After": "3"}
    assert BadRequest("x", Reason.TOO_LARGE, close=True).headers == {"Connection": "close"}


def test_decode_every_datatype_typed_and_raw():
    from servopt.serve.grpc_server import decode_infer_request, encode_infer_response
    from servopt.serve.protocol import DATATYPES, InferResponse, encode_bytes_tensor

    typed = {"BOOL": ("bool_contents", [True, False]), "INT8": ("int_contents", [-128, 127]), "UINT16": ("uint_contents", [0, 65535]),
             "INT32": ("int_contents", [-5, 5]), "INT64": ("int64_contents", [-(2**40), 2**40]), "UINT64": ("uint64_contents", [0, 2**63]),
             "FP32": ("fp32_contents", [0.5, -1.5]), "FP64": ("fp64_contents", [0.25, 1e300]), "BYTES": ("bytes_contents", [b"a", b"\x00bc"])}
    inputs = [pb.ModelInferRequest.InferInputTensor(name=dt, datatype=dt, shape=[1, 2], contents=pb.InferTensorContents(**{field: values}))
              for dt, (field, values) in typed.items()]
    req = decode_infer_request(pb.ModelInferRequest(model_name="m", id="x", inputs=inputs,
                                                    parameters={"priority": pb.InferParameter(int64_param=3)}))
    assert req.id == "x" and req.parameters == {"priority": 3} and req.requested_outputs is None
    for t in req.inputs:
        expected = np.array(typed[t.datatype][1], dtype=object if t.datatype == "BYTES" else None).reshape(1, 2)
        assert t.data.shape == (1, 2) and t.data.tolist() == expected.tolist(), t.datatype
        assert t.data.dtype == DATATYPES[t.datatype], t.datatype
    half = np.array([[1.5, -2.0]], np.float16)
    strings = np.array([b"hello", b""], dtype=object)
    raw = decode_infer_request(pb.ModelInferRequest(model_name="m", inputs=[
        pb.ModelInferRequest.InferInputTensor(name="h", datatype="FP16", shape=[1, 2]),
        pb.ModelInferRequest.InferInputTensor(name="s", datatype="BYTES", shape=[2])],
        raw_input_contents=[half.tobytes(), encode_bytes_tensor(strings)]))
    assert raw.inputs[0].data.dtype == np.float16 and raw.inputs[0].data.tolist() == half.tolist()
    assert raw.inputs[1].data.tolist() == [b"hello", b""]
    out = encode_infer_response(InferResponse(model_name="m", id=None, outputs={"s": strings, "h": half}))
    assert [(o.name, o.datatype, list(o.shape)) for o in out.outputs] == [("s", "BYTES", [2]), ("h", "FP16", [1, 2])]
    assert out.raw_output_contents[0] == encode_bytes_tensor(strings) and out.raw_output_contents[1] == half.tobytes()
    assert out.id == "" and out.model_version == "1"


def test_not_ready_is_unavailable(stack):
    stack.plane.ready = False
    try:
        assert not stack.stub.ServerReady(pb.ServerReadyRequest()).ready
        with pytest.raises(grpc.RpcError) as e:
            stack.stub.ModelInfer(request(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in e.value.details()
    finally:
        stack.plane.ready = True
    assert stack.stub.ServerReady(pb.ServerReadyRequest()).ready
