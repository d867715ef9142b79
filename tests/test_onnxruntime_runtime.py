"""The ONNX Runtime runtime's facts about itself: on the CPU provider it does not make the fusions whose CPU kernels are
slower than what they replace (``CPU_SLOW_FUSIONS``), says so in what ran, and makes them when asked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from servopt.contracts import Artifact
from servopt.runtimes import open_session
from servopt.runtimes.onnxruntime_runtime import CPU_SLOW_FUSIONS, OrtOptions, disabled_fusions

HIDDEN = 16


def residual_block(path: Path) -> Path:
    """A transformer's residual: x + bias + skip, then LayerNormalization (what SkipLayerNormFusion fuses)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32), n) for n in ("bias", "gamma", "beta")]
    nodes = [helper.make_node("Add", ["x", "bias"], ["xb"]), helper.make_node("Add", ["xb", "skip"], ["sum"]),
             helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4, HIDDEN]) for n in ("x", "skip", "y")]
    graph = helper.make_graph(nodes, "residual", io[:2], io[2:], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _ops_after_load(model: Path, out: Path, **options) -> tuple[list[str], dict]:
    artifact = Artifact(format="onnx", path=str(model))
    session = open_session(artifact, "onnxruntime", {"optimized_model_filepath": str(out), **options})
    return [n.op_type for n in onnx.load(out).graph.node], session.info().details


def test_the_cpu_provider_leaves_the_slow_fusions_unmade(tmp_path):
    model = residual_block(tmp_path / "residual.onnx")
    ops, details = _ops_after_load(model, tmp_path / "default.onnx")
    assert "SkipLayerNormalization" not in ops and "LayerNormalization" in ops
    assert details["disabled_fusions"] == list(CPU_SLOW_FUSIONS)
    fused_ops, fused_details = _ops_after_load(model, tmp_path / "fused.onnx", cpu_slow_fusions=True)
    assert "SkipLayerNormalization" in fused_ops and fused_details["disabled_fusions"] == []

    feed = {"x": np.random.default_rng(1).standard_normal((2, 4, HIDDEN)).astype(np.float32),
            "skip": np.random.default_rng(2).standard_normal((2, 4, HIDDEN)).astype(np.float32)}
    a = open_session(Artifact(format="onnx", path=str(model)), "onnxruntime").run(feed)
    b = open_session(Artifact(format="onnx", path=str(model)), "onnxruntime", {"cpu_slow_fusions": True}).run(feed)
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("provider", ["CUDAExecutionProvider", "TensorrtExecutionProvider", "OpenVINOExecutionProvider"])
def test_other_providers_keep_every_fusion(provider):
    assert disabled_fusions(OrtOptions(), provider) == []
    assert disabled_fusions(OrtOptions(), "CPUExecutionProvider") == list(CPU_SLOW_FUSIONS)


def test_the_transformer_optimizer_knows_every_flag():
    """Each slow fusion names a real FusionOptions flag, so the offline pass leaves the same operators unfused."""
    from onnxruntime.transformers.fusion_options import FusionOptions

    options = FusionOptions("bert")
    for flag in CPU_SLOW_FUSIONS.values():
        assert isinstance(getattr(options, flag), bool), flag


def test_spinning_as_the_options_set_it(tmp_path):
    """Servers do not spin unless the user bounds it; the bound reaches ORT's session config and what ran says it."""
    from servopt.runtimes.onnxruntime_runtime import OnnxRuntime, session_options

    rt = OnnxRuntime()
    served = rt.serving_options(OrtOptions())
    assert served.allow_spinning is False
    bounded = rt.serving_options(OrtOptions(spin_duration_us=100))
    assert bounded.allow_spinning and bounded.spin_duration_us == 100
    so = session_options(bounded)
    assert so.get_session_config_entry("session.intra_op.spin_duration_us") == "100"
    assert session_options(served).get_session_config_entry("session.intra_op.allow_spinning") == "0"
    artifact = Artifact(format="onnx", path=str(residual_block(tmp_path / "r.onnx")))
    ran = {o: open_session(artifact, "onnxruntime", rt.serving_options(OrtOptions(**kw))).info().details["intra_op_spinning"]
           for o, kw in {"off": {}, "bounded": {"spin_duration_us": 100}}.items()}
    assert ran == {"off": "off", "bounded": "100 us"}
    assert open_session(artifact, "onnxruntime").info().details["intra_op_spinning"] == "ORT default"
    with pytest.raises(Exception, match="spin_duration_us"):
        rt.parse_options({"spin_duration_us": 0})


def test_the_gpu_runtime_uses_this_interpreter_where_it_is_the_gpu_build(monkeypatch):
    """A GPU host provisioned ahead (onnxruntime-gpu installed, no registry to build an environment from) measures in
    this interpreter; elsewhere onnxruntime-gpu gets an environment of its own, so the CPU build is never overwritten."""
    from importlib import metadata

    from servopt.runtimes.onnxruntime_runtime import OnnxRuntimeCuda

    real = metadata.version

    def installed(name: str) -> str:
        return "1.24.1" if name == "onnxruntime-gpu" else real(name)

    def missing(name: str) -> str:
        if name == "onnxruntime-gpu":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert "onnxruntime-gpu" in " ".join(OnnxRuntimeCuda().environment().requirements)
    monkeypatch.setattr(metadata, "version", installed)
    assert OnnxRuntimeCuda().environment() is None
