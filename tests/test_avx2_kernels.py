"""The model of x86's U8S8 kernel that servopt decides by (``passes.int8_overflow``), checked against the kernels of
an AVX2 CPU without VNNI themselves: pairs of neighbours along the reduction axis summed into a saturating int16, a
convolution's reduction axis ordered [kh][kw][C], signed activations exact.

These run only where CPUID says the CPU is one (AVX2, no AVX-512, no VNNI): natively on a Zen 2/3 EPYC, and on any
x86 host under ``benchmarks/avx2_cpu.sh`` (qemu's EPYC-Milan), which ``make test`` does where qemu-user is installed.
Elsewhere they are skipped: what they assert is what that CPU computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import conv_model
from servopt.machine import cpuid_features, host_features
from servopt.passes.int8_overflow import emulate_u8s8_kernel, u8s8_overflow


def avx2_without_vnni() -> bool:
    """What the kernels see: CPUID, and /proc/cpuinfo for AVX-VNNI, which numpy does not name."""
    cpuid = cpuid_features()
    return bool(cpuid.get("AVX2") and not cpuid.get("AVX512F") and not cpuid.get("AVX512VNNI")
                and "avx_vnni" not in host_features().flags)


pytestmark = [pytest.mark.avx2_kernels,
              pytest.mark.skipif(not avx2_without_vnni(), reason="needs an AVX2 CPU without VNNI: run through "
                                 "benchmarks/avx2_cpu.sh (qemu-user) on any other x86 CPU")]


def _run(path: Path | str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _matmul_integer(path: Path, w: np.ndarray, activation: int) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("a", activation, ["m", w.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, ["m", w.shape[1]])],
                              [numpy_helper.from_array(w.astype(np.int8), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def test_u8s8_pairs_saturate_as_the_emulation_says(tmp_path):
    from onnx import TensorProto

    rng = np.random.default_rng(0)
    w = rng.integers(-128, 128, (64, 48))
    w[:8] = 127  # four pairs of full-range weights in every column: they overflow
    model = _matmul_integer(tmp_path / "m.onnx", w, TensorProto.UINT8)
    a = rng.integers(0, 256, (16, 64)).astype(np.uint8)
    a[:, :8] = 255
    real = _run(model, {"a": a})
    assert (real != a.astype(np.int64) @ w).any()  # the kernel saturates here
    np.testing.assert_array_equal(real, _run(emulate_u8s8_kernel(str(model), tmp_path / "sat.onnx"), {"a": a}))
    assert not u8s8_overflow(str(model))["safe_without_vnni"]
    halved = _matmul_integer(tmp_path / "7bit.onnx", w // 2, TensorProto.UINT8)  # 7-bit weights: exact
    np.testing.assert_array_equal(_run(halved, {"a": a}), a.astype(np.int64) @ (w // 2))
    assert u8s8_overflow(str(halved))["safe_without_vnni"]


def test_signed_activations_are_exact(tmp_path):
    """S8S8 does not go through the U8S8 pairs: the count leaves s8 activations out, rightly."""
    from onnx import TensorProto

    w = np.array([[127, 64, 127, -128], [127, 64, -127, -1]] * 2)
    model = _matmul_integer(tmp_path / "s8.onnx", w, TensorProto.INT8)
    for value in (127, -128):
        a = np.full((1, 4), value, np.int8)
        np.testing.assert_array_equal(_run(model, {"a": a}), a.astype(np.int64) @ w)


def _qlinear_conv(path: Path, w: np.ndarray, y_scale: float) -> Path:
    """One QLinearConv: u8 input (scale 1, zero point 0), s8 weights (scale 1), u8 output at ``y_scale``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    c = w.shape[1]
    consts = {"xs": np.float32(1), "xz": np.uint8(0), "w": w.astype(np.int8), "ws": np.float32(1), "wz": np.int8(0),
              "ys": np.float32(y_scale), "yz": np.uint8(0)}
    graph = helper.make_graph([helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, c, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [1, w.shape[0], 1, 1])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def test_a_convolution_pairs_its_weights_in_the_order_the_count_reads(tmp_path):
    """A 3x3 convolution of two input channels, a full u8 input: 127 at one tap of both channels is one pair in
    MLAS's [kh][kw][C] order (it saturates: 32767 for 64770), 127 at two taps of one channel is not (exact), though
    in ONNX's [C][kh][kw] order the two would be neighbours. The count reads the same: one pair, then none."""
    x = np.full((1, 2, 3, 3), 255, np.uint8)
    one_tap = np.zeros((8, 2, 3, 3))  # eight output channels, so the kernel runs as it does on a real layer
    one_tap[:, :, 0, 0] = 127
    two_taps = np.zeros((8, 2, 3, 3))
    two_taps[:, 0, 0, :2] = 127
    exact = 255 * 254
    scale = 510.0  # 64770 -> 127; 32767 -> 64
    paired = _run(_qlinear_conv(tmp_path / "pair.onnx", one_tap, scale), {"x": x})
    apart = _run(_qlinear_conv(tmp_path / "apart.onnx", two_taps, scale), {"x": x})
    assert paired.ravel().tolist() == [round(32767 / scale)] * 8
    assert apart.ravel().tolist() == [round(exact / scale)] * 8
    assert u8s8_overflow(str(tmp_path / "pair.onnx"))["u8s8_overflowing_pairs"] == 8
    assert u8s8_overflow(str(tmp_path / "apart.onnx"))["u8s8_overflowing_pairs"] == 0


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_a_qdq_graph_s_signed_activations_are_shifted_into_the_pairs(tmp_path, runtime):
    """A QDQ S8S8 model, its 1x1 conv's all-positive column full range (the count: 2 shifted pairs overflow): on
    calibration inputs that column comes out far from the float model's in both runtimes, where its 7-bit twin stays
    within quantization error. (On a VNNI CPU both are close: 32-bit sums.)"""
    from servopt.data.dataset import Dataset
    from servopt.models.sources import load_model
    from servopt.passes import BuildContext, build_chain, source_artifact
    model = load_model(conv_model(tmp_path / "m.onnx"))
    calib = np.abs(np.random.default_rng(0).standard_normal((16, 4, 6, 6))).astype(np.float32)
    ctx = BuildContext(source=model, calibration=Dataset({"input": calib}))

    def qdq(reduce_range: bool):
        params = {"quant_format": "QDQ", "activation_type": "S8", "weight_type": "S8", "per_channel": True,
                  "calibrate_method": "MinMax", "calibration_samples": 16, "reduce_range": reduce_range}
        return build_chain(source_artifact(model), [("ort-quantize-static", params)], tmp_path / "cache", ctx)

    full, seven = qdq(False), qdq(True)
    assert full.report["s8s8_overflowing_pairs"] == 2 and seven.report["s8s8_overflowing_pairs"] == 0
    x = calib[:4]  # inputs the calibration saw (beyond its range the output's own quantization clips)
    reference = _run(model.path, {"input": x})[:, 0]

    def column(path: str) -> np.ndarray:
        if runtime == "onnxruntime":
            return _run(path, {"input": x})[:, 0]
        import openvino as ov

        compiled = ov.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        return compiled({"input": x})[compiled.output(0)][:, 0]

    # measured: reference 67.2, 74.4, 68.1, 65.2; 7-bit 67.4, 74.5, 68.0, 65.1; full range 2.37 for every input
    assert (abs(column(seven.path) / reference - 1) < 0.05).all()
    assert (abs(column(full.path) / reference - 1) > 0.5).all()
