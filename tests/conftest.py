"""Shared fixtures. Every test runs with HOME, caches and TMPDIR in a temporary folder:
ONNX Runtime / OpenVINO telemetry and torch.compile write there, never into the real home."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

_SANDBOX = Path(tempfile.mkdtemp(prefix="servopt-tests-"))
for var, sub in (("HOME", "home"), ("XDG_CACHE_HOME", "cache"), ("TMPDIR", "tmp"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
    (_SANDBOX / sub).mkdir(parents=True, exist_ok=True)
    os.environ[var] = str(_SANDBOX / sub)
os.environ.setdefault("SERVOPT_HOME", str(_SANDBOX / "servopt-home"))
tempfile.tempdir = str(_SANDBOX / "tmp")


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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """An ASGI app served by uvicorn in a thread on a free loopback port (``with Running(app) as url: …``)."""

    def __init__(self, app) -> None:
        import threading

        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Running:
        import time

        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        assert self.server.started, "the server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


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
