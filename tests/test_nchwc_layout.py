"""A graph ONNX Runtime saved at level "all" keeps its convolutions in this CPU's NCHWc block (16 channels with
AVX-512F, 8 with AVX2), and another CPU runs it without complaint and answers wrongly: the demo's, saved on an AVX-512
Zen 4, scored 9.8 % top-1 (chance: 10 classes) on an AVX2 CPU (qemu's EPYC-Milan, ``benchmarks/avx2_quality.py``).
The pass stamps the block into the model, every load checks it, and ``decide`` fails such a graph for a target of
another block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from servopt.cpu import CpuFeatures
from servopt.errors import UserError
from servopt.machine import host_features
from servopt.models.sources import load_model
from servopt.passes import BuildContext, build_chain, source_artifact
from servopt.runtimes import open_session
from servopt.runtimes.onnxruntime_runtime import NCHWC_BLOCK_KEY, check_nchwc_block

AVX2 = CpuFeatures(frozenset({"avx2", "fma"}))
ZEN4 = CpuFeatures(frozenset({"avx2", "fma", "avx512f", "avx512_vnni"}))
GRAVITON = CpuFeatures(frozenset({"asimd", "asimddp"}))


def cnn(path: Path) -> Path:
    """3 → 16 channels (3x3) → ReLU → 32 channels (1x1) → pooled logits: channel counts both blocks divide, so the
    layout optimizer takes every convolution on either CPU."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]), helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"]),
             helper.make_node("GlobalAveragePool", ["c2"], ["p"]), helper.make_node("Flatten", ["p"], ["logits"])]
    init = {"w1": rng.standard_normal((16, 3, 3, 3)), "b1": rng.standard_normal(16),
            "w2": rng.standard_normal((32, 16, 1, 1)), "b2": rng.standard_normal(32)}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 12, 12])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 32])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in init.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_the_block_follows_the_instruction_set():
    assert (AVX2.nchwc_block, ZEN4.nchwc_block, GRAVITON.nchwc_block) == (8, 16, None)
    assert [CpuFeatures.nchwc_block_of(level) for level in ("avx2", "avx512", "avx512_vnni", "amx", "arm", None)] == \
        [8, 16, 16, 16, None, None]


def test_a_load_refuses_a_graph_of_another_block():
    stamped = {NCHWC_BLOCK_KEY: "16"}
    check_nchwc_block(stamped, "m.onnx", ZEN4)
    check_nchwc_block({}, "m.onnx", AVX2)  # a graph without the layout (or saved before the stamp): nothing to check
    check_nchwc_block(stamped, "m.onnx", GRAVITON)  # a CPU whose block servopt does not know: ONNX Runtime's call
    with pytest.raises(UserError, match="blocks of 16 channels; this CPU's uses 8"):
        check_nchwc_block(stamped, "m.onnx", AVX2)


def test_the_offline_graph_is_stamped_with_the_block_it_was_saved_in(tmp_path):
    import onnx

    here = host_features().nchwc_block
    if here is None:
        pytest.skip("not an x86 CPU with AVX2: ONNX Runtime saves no NCHWc graph here")
    model = load_model(cnn(tmp_path / "m.onnx"))
    saved = build_chain(source_artifact(model), [("ort-graph-offline", {"level": "all"})], tmp_path / "cache",
                        BuildContext(source=model))
    assert saved.report["nchwc_block"] == here and saved.report["nchwc_nodes"] >= 2
    x = np.random.default_rng(1).standard_normal((2, 3, 12, 12)).astype(np.float32)
    original = open_session(source_artifact(model), "onnxruntime").run({"input": x})
    loaded = open_session(saved, "onnxruntime", {"graph_optimization_level": "disable"}).run({"input": x})
    np.testing.assert_allclose(loaded, original, rtol=1e-4, atol=1e-4)
    # the same graph claiming the other block: refused at load, on any x86 CPU
    other = onnx.load(saved.path)
    onnx.helper.set_model_props(other, {NCHWC_BLOCK_KEY: str(24 - here)})
    onnx.save(other, str(tmp_path / "other.onnx"))
    with pytest.raises(UserError, match=f"blocks of {24 - here} channels"):
        open_session({"format": "onnx", "path": str(tmp_path / "other.onnx")}, "onnxruntime",
                     {"graph_optimization_level": "disable"})
    # a level that does not change the layout writes no stamp
    basic = build_chain(source_artifact(model), [("ort-graph-offline", {"level": "extended"})], tmp_path / "cache",
                        BuildContext(source=model))
    assert "nchwc_block" not in basic.report


def test_decide_fails_a_graph_of_another_block_for_the_target():
    from servopt.contracts import Accuracy, Artifact, ClassificationQuality, Latency, Record, Throughput
    from servopt.families import FAMILIES
    from servopt.optimize.decide import judge
    from servopt.optimize.targets import PRESETS

    rec = Record(name="ort-offline-all", runtime="onnxruntime", status="ok", size_mb=9, latency_ms=Latency(p50=1),
                 throughput_ips=Throughput(batch=2000),
                 quality=ClassificationQuality(accuracy=Accuracy(top1=0.95, top5=1, correct=1, total=1)),
                 artifact=Artifact(format="onnx", path="m.onnx", report={"level": "all", "nchwc_block": 16, "nchwc_nodes": 52}))
    family = FAMILIES.get("image-classification")
    avx2 = PRESETS["cpu-server"]  # the seed's EPYC 7763: AVX2
    verdict = judge(avx2, rec, rec, family)
    bound = next(b for b in verdict.bounds if b.bound == "runs_on_target_isa")
    assert not verdict.passes and bound.status == "fail" and "NCHWc" in bound.note
    vnni = avx2.model_copy(update={"isa": "avx512_vnni"})
    assert not any(b.bound == "runs_on_target_isa" for b in judge(vnni, rec, rec, family).bounds)
    edge = next(b for b in judge(PRESETS["edge"], rec, rec, family).bounds if b.bound == "runs_on_target_isa")
    assert edge.status == "fail" and "ARM Cortex-A76" in edge.note
