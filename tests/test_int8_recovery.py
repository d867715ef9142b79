"""INT8 that keeps its accuracy on a model built to resist plain calibration (issue 15).

The model: Conv(3→8) → ReLU → Conv(8→4) → GlobalAveragePool, with channel 0 of the first layer scaled up 1000× and
the second layer's input channel 0 scaled down as much. The function is that of a well-behaved network, but the
activation between the layers has one channel 1000× wider than the rest: a per-tensor activation scale set by it
leaves the other seven channels a level or two, and plain MinMax calibration loses the model. Cross-layer
equalization brings the channel back in line and the same quantizer keeps it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from servopt.contracts import Artifact
from servopt.cpu import CpuFeatures
from servopt.data.dataset import Dataset
from servopt.families.catalogue import nncf_onnx, nncf_ov
from servopt.models.sources import load_model
from servopt.passes import BuildContext, build_chain, source_artifact
from servopt.runtimes import open_session

OUTLIER = 1000.0


def hard_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w1 = rng.standard_normal((8, 3, 1, 1)).astype(np.float32)
    b1 = rng.uniform(0.2, 0.5, 8).astype(np.float32)
    w2 = rng.standard_normal((4, 8, 1, 1)).astype(np.float32)
    w1[0] *= OUTLIER
    b1[0] *= OUTLIER
    w2[:, 0] /= OUTLIER
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (np.zeros(4, np.float32), "b2"))]
    nodes = [helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2"),
             helper.make_node("GlobalAveragePool", ["c2"], ["pooled"], name="pool"),
             helper.make_node("Flatten", ["pooled"], ["logits"], name="flatten")]
    graph = helper.make_graph(nodes, "hard", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 4, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _outputs(artifact: Artifact, data: Dataset) -> np.ndarray:
    return open_session(artifact, "onnxruntime").run(data.rows(slice(None)))


@pytest.fixture(scope="module")
def hard(tmp_path_factory):
    """(model, calibration/tuning split, evaluation split): labels are the float model's own argmax, on inputs whose
    top-2 margin is clear, so the float model scores 100 % and every lost point is the quantizer's."""
    path = hard_model(tmp_path_factory.mktemp("hard") / "hard.onnx")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1600, 3, 4, 4)).astype(np.float32)
    logits = _outputs(Artifact(format="onnx", path=str(path)), Dataset({"input": x}))
    top2 = np.sort(logits, axis=1)[:, -2:]
    keep = (top2[:, 1] - top2[:, 0]) > 0.02 * np.abs(logits).max()
    x, labels = x[keep][:600], logits[keep][:600].argmax(1)
    calib = Dataset({"input": x[:200]}, labels[:200], ["a", "b", "c", "d"], "hard")
    evaluation = Dataset({"input": x[200:]}, labels[200:], ["a", "b", "c", "d"], "hard")
    return load_model(path), calib, evaluation


def _accuracy(artifact: Artifact, data: Dataset) -> float:
    return float((_outputs(artifact, data).argmax(1) == data.labels).mean())


def _build(hard, chain, tmp_path) -> Artifact:
    model, calib, _ = hard
    return build_chain(source_artifact(model), chain, tmp_path, BuildContext(source=model, calibration=calib, tuning=calib))


STATIC = ("ort-quantize-static", {"quant_format": "QOperator", "activation_type": "U8", "weight_type": "S8", "per_channel": True})


def test_equalization_keeps_the_function_and_evens_the_channels(hard, tmp_path):
    import onnx
    from onnx import numpy_helper

    model, _, evaluation = hard
    equalized = _build(hard, [("equalize", {})], tmp_path)
    original = _outputs(source_artifact(model).opened(), evaluation)
    np.testing.assert_allclose(_outputs(equalized, evaluation), original, rtol=1e-4, atol=1e-4 * np.abs(original).max())
    assert equalized.report["pairs"] == 1 and equalized.report["largest_factor"] > 10
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(equalized.path).graph.initializer}
    ranges = np.abs(weights["w1"].reshape(8, -1)).max(axis=1)
    assert ranges.max() / ranges.min() < 20, "the outlier channel's range is in line with the others after equalization"


def test_plain_calibration_fails_and_equalization_recovers_it(hard, tmp_path):
    _, _, evaluation = hard
    plain = _accuracy(_build(hard, [STATIC], tmp_path), evaluation)
    recovered = _accuracy(_build(hard, [("equalize", {}), STATIC], tmp_path), evaluation)
    assert plain < 0.90, f"the hard model must defeat plain MinMax calibration (top-1 {plain:.3f})"
    assert recovered >= 0.99, f"equalization + the same quantizer is within 1 point of float (top-1 {recovered:.3f})"


@pytest.mark.slow
def test_nncf_on_onnx_recovers_with_equalization_and_runs_unsigned(hard, tmp_path):
    """The catalogue's ``ort-int8-cle-nncf`` chain on a CPU without fast signed INT8: within a point, and every
    activation quantizer unsigned (the U8S8 kernels ONNX Runtime runs fast there)."""
    import onnx

    _, _, evaluation = hard
    cpu = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni"}))
    built = _build(hard, [("equalize", {}), nncf_onnx(cpu)], tmp_path)
    assert _accuracy(built, evaluation) >= 0.99
    graph = onnx.load(built.path).graph
    inits = {t.name: t.data_type for t in graph.initializer}
    zero_points = [inits[n.input[2]] for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits]
    assert zero_points and all(t == onnx.TensorProto.UINT8 for t in zero_points)
    assert built.report["activations"] == "unsigned" and built.report["overflow_fix"] == "disable"


@pytest.mark.slow
def test_unsigned_rewrite_is_numerically_the_same_model(hard, tmp_path):
    _, _, evaluation = hard
    signed = _build(hard, [("equalize", {}), ("nncf-quantize-onnx", {"activations": "signed"})], tmp_path)
    unsigned = _build(hard, [("equalize", {}), ("nncf-quantize-onnx", {"activations": "unsigned"})], tmp_path)
    np.testing.assert_allclose(_outputs(unsigned, evaluation), _outputs(signed, evaluation), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_calibration_search_reports_every_point_and_picks_within_tolerance(hard, tmp_path):
    _, _, evaluation = hard
    built = _build(hard, [("equalize", {}), ("ort-quantize-calibration-search", {"max_points": 4, "timing_runs": 5})], tmp_path)
    report = built.report
    assert len(report["points"]) == 4 and report["within_tolerance"]
    chosen = [p for p in report["points"] if all(p[k] == v for k, v in report["chosen"].items())]
    assert chosen and chosen[0]["within_tolerance"] and "p50_ms" in chosen[0]
    assert _accuracy(built, evaluation) >= 0.98


def test_saturation_follows_the_cpu():
    """U8S8 saturates on x86 without 8-bit dot products only; the catalogue then adds 7-bit-weight variants and asks
    NNCF for its overflow fix."""
    avx2 = CpuFeatures(frozenset({"avx2", "fma"}))
    vnni = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni"}))
    arm = CpuFeatures(frozenset({"asimd"}))
    assert avx2.int8_saturates and not vnni.int8_saturates and not arm.int8_saturates
    assert nncf_onnx(avx2)[1]["overflow_fix"] == "enable" and nncf_onnx(vnni)[1]["overflow_fix"] == "disable"
    assert nncf_onnx(avx2)[1]["activations"] == "unsigned"
    assert nncf_onnx(CpuFeatures(frozenset({"avx2", "avx_vnni_int8", "avx_vnni"})))[1]["activations"] == "signed"
    # OpenVINO's INT8 alike (its oneDNN shifts signed activations into the same pairs): NNCF's fix on every layer,
    # ORT's QDQ model for it in 7 bits
    assert nncf_ov(avx2, preset="mixed")[1] == {"overflow_fix": "enable", "preset": "mixed"}
    assert nncf_ov(vnni)[1] == {}
    from servopt.passes import get_pass

    ov = get_pass("nncf-quantize")  # what the race ranks it on: 7-bit with the fix everywhere; NNCF's default untold
    assert [ov.int8_kernel(ov.read_params({"overflow_fix": f})) for f in ("enable", "disable", "first_layer")] == \
        ["u8s8-7bit", "u8s8", None]
    from servopt.families import FAMILIES
    from servopt.families.catalogue import CatalogueContext
    from servopt.spec import ModelSpec, TensorSpec

    spec = ModelSpec(inputs=[TensorSpec(name="input", dtype="float32", shape=["batch", 3, 224, 224])],
                     outputs=[TensorSpec(name="logits", dtype="float32", shape=["batch", 10])])
    for seven in (True, False):  # for a target without VNNI, on this VNNI CPU; for this CPU alone
        ctx = CatalogueContext(spec=spec, is_torch=True, linear_heavy=False, cpu=vnni, deploy_without_vnni=seven)
        by = {v.name: v for v in FAMILIES.get("image-classification").catalogue(ctx)}
        assert by["ov-int8-qdq"].chain[-1][1]["reduce_range"] is seven
        assert (by["nncf-int8-latency"].chain[-1][1].get("overflow_fix") == "enable") is seven


@pytest.mark.slow
def test_accuracy_aware_ranks_float_islands_by_cost_and_meets_the_tolerance(hard, tmp_path):
    """Neither plain calibration nor NNCF alone keeps the hard model: the search falls back layers to float, ranked by
    error removed per millisecond (each probed unit timed), and ends within the tolerance."""
    _, _, evaluation = hard
    built = _build(hard, [("ort-quantize-accuracy-aware", {**STATIC[1], "max_drop": 1.0, "timing_runs": 5,
                                                          "try_calibrations": []})], tmp_path)
    report = built.report
    labels = [s["label"] for s in report["steps"]]
    assert any("NNCF" in label for label in labels), "NNCF's PTQ is tried as a full-INT8 base"
    assert report["float_layers"], "the tolerance needs a layer in float here"
    assert report["float_island_costs"] and all("cost_ms" in c and "per_ms" in c for c in report["float_island_costs"])
    assert _accuracy(built, evaluation) >= 0.98


def test_demo_seed_trains_another_model_and_keeps_seed_0s_cache(tmp_path):
    """``servopt demo --seed N``: each seed its own cached weights (its recipe hash); seed 0 keeps the path it always had,
    so an existing cache is not retrained."""
    from servopt.demo import RECIPE, demo_model_path, recipe

    assert recipe(0) == RECIPE
    paths = {demo_model_path(tmp_path, seed) for seed in (0, 1, 2)}
    assert len(paths) == 3 and all(p.parent == tmp_path / "demo" for p in paths)
    import hashlib
    import json

    assert demo_model_path(tmp_path).name.endswith(hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12] + ".pt")
