"""What x86 without VNNI computes of an INT8 model (``passes.int8_overflow``), read from the weights on any CPU: every
INT8 recipe's build carries its count, a runtime says whether its kernels sum pairs in int16, and ``decide`` fails
a model that can overflow for a target naming such a CPU (issue 40: static U8S8 lost 5.43 points on a Zen 3)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import conv_model
from servopt.data.dataset import Dataset
from servopt.models.sources import load_model
from servopt.passes import BuildContext, build_chain, source_artifact
from servopt.passes.int8_overflow import u8s8_overflow, u8s8_weights


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The model quantized statically in each format, through ``build_chain`` (which adds the count to the report)."""
    tmp = tmp_path_factory.mktemp("overflow")
    model = load_model(conv_model(tmp / "m.onnx"))
    x = np.abs(np.random.default_rng(0).standard_normal((16, 4, 6, 6))).astype(np.float32)
    ctx = BuildContext(source=model, calibration=Dataset({"input": x}))

    def static(fmt: str, act: str, wt: str, reduce_range: bool = False, per_channel: bool = True):
        params = {"quant_format": fmt, "activation_type": act, "weight_type": wt, "per_channel": per_channel,
                  "calibrate_method": "MinMax", "calibration_samples": 16, "reduce_range": reduce_range}
        return build_chain(source_artifact(model), [("ort-quantize-static", params)], tmp / "cache", ctx)

    return {"qop-u8s8": static("QOperator", "U8", "S8"), "qdq-u8s8": static("QDQ", "U8", "S8"),
            "qop-u8s8-rr": static("QOperator", "U8", "S8", True), "qop-u8u8": static("QOperator", "U8", "U8"),
            "qop-u8u8-per-tensor": static("QOperator", "U8", "U8", per_channel=False), "qdq-s8s8": static("QDQ", "S8", "S8")}


def test_static_u8s8_weights_are_counted_in_the_kernel_s_pairs(built):
    """QLinearConv (QOperator) and DequantizeLinear → Conv (QDQ, fused by ONNX Runtime) alike: the plain conv's two
    columns of two pairs each, the all-positive column's both overflowing; the depthwise conv is not paired. ONNX
    Runtime's quantizer (1.32) writes per-channel conv weights as s8 even when asked for U8: its "U8U8" is U8S8 on a
    CNN, and saturates like it — what the weights say, not the recipe's name, is counted."""
    for name in ("qop-u8s8", "qdq-u8s8", "qop-u8u8"):
        assert built[name].report["u8s8_weight_pairs"] == 4, name
        assert built[name].report["u8s8_overflowing_pairs"] == 2 and built[name].report["safe_without_vnni"] is False, name
    (w,) = list(u8s8_weights(built["qop-u8s8"].path))
    assert w.shape == (4, 2) and w[:, 0].tolist() == [127] * 4, "K × N, the all-positive column full range"


def test_recipes_that_cannot_saturate_are_safe(built):
    """7-bit weights cannot overflow (at most 255 × 128); u8 weights run U8U8 kernels."""
    assert built["qop-u8s8-rr"].report["safe_without_vnni"] and built["qop-u8s8-rr"].report["u8s8_weight_pairs"] == 4
    report = built["qop-u8u8-per-tensor"].report
    assert (report["u8s8_weight_pairs"], report["s8s8_weight_pairs"], report["safe_without_vnni"]) == (0, 0, True)


def test_a_qdq_graph_s_signed_activations_are_counted_as_shifted_into_the_pairs(built):
    """x86 runs a QDQ graph's s8 activations on the U8S8 kernel moved by 128 (ONNX Runtime rewrites them to u8,
    OpenVINO's oneDNN shifts them): the same pairs overflow. ORT's QDQ S8S8 MobileNetV2 scored 86.5 % top-1 on an
    AVX2 CPU against 96.9 % on a VNNI one (``tests/test_avx2_kernels.py`` checks the kernels where they run)."""
    report = built["qdq-s8s8"].report
    assert (report["u8s8_weight_pairs"], report["s8s8_weight_pairs"], report["s8s8_overflowing_pairs"]) == (0, 4, 2)
    assert report["safe_without_vnni"] is False
    assert built["qop-u8s8"].report["s8s8_weight_pairs"] == 0  # u8 activations: counted once, as u8s8


def test_each_quantizer_says_before_it_builds_which_product_its_weights_hold(built):
    """``Pass.int8_kernel`` (what the race ranks on) agrees with the weights the build wrote (what decide reads)."""
    from servopt.passes import get_pass

    static = get_pass("ort-quantize-static")
    for name, artifact in built.items():
        kernel = static.int8_kernel(static.read_params(artifact.params))
        assert (kernel == "u8s8") == (artifact.report["u8s8_overflowing_pairs"] > 0), name
        assert (kernel in ("u8s8", "u8s8-7bit")) == (artifact.report["u8s8_weight_pairs"] > 0), name


def test_a_float_model_has_nothing_to_overflow(tmp_path):
    assert u8s8_overflow(str(conv_model(tmp_path / "f.onnx")))["u8s8_weight_pairs"] == 0


def test_what_a_runtime_runs_of_a_quantized_model_and_what_the_cpu_makes_of_it():
    """ONNX Runtime runs the model's product, U8U8 under x64 precision; OpenVINO runs signed activations as U8S8. The
    CPU says what goes wrong: full-range U8S8 without VNNI, S8S8 without fast signed kernels."""
    from servopt.cpu import CpuFeatures
    from servopt.runtimes import get_runtime

    ort = get_runtime("onnxruntime")
    assert ort.int8_kernel("u8s8", {}) == "u8s8" and ort.int8_kernel("u8s8", {"x64_quant_precision": True}) == "u8u8"
    assert ort.int8_kernel("s8s8", {"x64_quant_precision": True}) == "s8s8"
    ov = get_runtime("openvino")  # oneDNN shifts signed activations into its u8 × s8 product
    assert ov.int8_kernel("s8s8", {"hint": "LATENCY"}) == "u8s8" and ov.int8_kernel("u8s8-7bit", {}) == "u8s8-7bit"
    avx2, vnni = CpuFeatures(frozenset({"avx2", "fma"})), CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert "saturate" in avx2.int8_trouble("u8s8") and vnni.int8_trouble("u8s8") is None
    assert avx2.int8_trouble("u8s8-7bit") is None and avx2.int8_trouble("u8u8") is None
    assert "signed" in vnni.int8_trouble("s8s8") and CpuFeatures(frozenset({"asimd", "asimddp"})).int8_trouble("s8s8") is None


def test_decide_fails_signed_activations_that_overflow_on_the_target_whatever_runs_them():
    """A QDQ S8S8 model whose shifted pairs overflow fails an AVX2 target in ONNX Runtime (even under x64 precision,
    not known to cover them) and in OpenVINO; full-range U8S8 under x64 precision (U8U8 kernels) passes."""
    from servopt.contracts import Accuracy, Artifact, ClassificationQuality, Latency, Record, Throughput
    from servopt.families import FAMILIES
    from servopt.optimize.decide import judge
    from servopt.optimize.targets import PRESETS

    def verdict(runtime: str, options: dict, **counts: int):
        report = {"u8s8_overflowing_pairs": 0, "s8s8_overflowing_pairs": 0, **counts}
        report["safe_without_vnni"] = not any(counts.values())
        rec = Record(name="v", runtime=runtime, status="ok", size_mb=2, latency_ms=Latency(p50=1), options=options,
                     throughput_ips=Throughput(batch=2000), artifact=Artifact(format="onnx", path="m.onnx", report=report),
                     quality=ClassificationQuality(accuracy=Accuracy(top1=0.95, top5=1, correct=1, total=1)))
        v = judge(PRESETS["cpu-server"], rec, rec, FAMILIES.get("image-classification"))
        return next((b for b in v.bounds if b.bound == "runs_on_target_isa"), None)

    for runtime, options in (("onnxruntime", {}), ("onnxruntime", {"x64_quant_precision": True}), ("openvino", {})):
        bound = verdict(runtime, options, s8s8_overflowing_pairs=2)
        assert bound is not None and bound.status == "fail" and "signed activations" in bound.note, (runtime, options)
    assert verdict("onnxruntime", {"x64_quant_precision": True}, u8s8_overflowing_pairs=2) is None
    assert verdict("onnxruntime", {}, u8s8_overflowing_pairs=2).status == "fail"
