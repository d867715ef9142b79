"""INT8 on x86 CPUs without 8-bit dot products (VNNI): what ONNX Runtime's U8S8 kernels compute there.

MLAS multiplies u8 activations by s8 weights with ``vpmaddubsw``, which adds the products of two neighbours along the
reduction axis into a saturating int16: weights ``w0, w1`` of one output column overflow when ``255 * (w0 + w1)`` (the
same-signed ones) passes 32767. A model built and verified on a VNNI machine (32-bit sums) can therefore answer wrongly
on an AVX2 one, and no measurement here shows it. Two tools, for every quantizer's output (``build_chain`` records the
count for every INT8 recipe's ONNX model, and ``decide`` reads it for a target naming a CPU without VNNI):
- ``u8s8_overflow``: how many weight pairs of the model can overflow (a property of the weights alone);
- ``emulate_u8s8_kernel``: the model with those products done in float, saturated as that kernel does or exact as a
  VNNI kernel sums, so a test checks either CPU's answer on any CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

INT16_MAX = 32767
# Weight input of the integer products whose activations are u8 at run time (dynamic quantization's and the fused
# transformer operators'): (operator, weight input, activation zero-point input or None).
INTEGER_PRODUCTS = {"MatMulInteger": (1, 2), "DynamicQuantizeMatMul": (1, None), "MatMulIntegerToFloat": (1, 4),
                    "QAttention": (1, 7), "QLinearMatMul": (3, 2), "QLinearConv": (3, 2), "QGemm": (3, 2)}
# A QDQ model's float operators whose weight input a DequantizeLinear of s8 weights feeds: ONNX Runtime fuses them
# into the integer operators above at session time.
QDQ_WEIGHTED = {"Conv": 1, "MatMul": 1, "Gemm": 1}


def _reduction_major(op: str, w, node) -> object | None:
    """The weights as (reduction axis K, output columns N), K in the order MLAS packs it; None where the kernel does
    not pair neighbours (a depthwise convolution: MLAS computes it in 32 bits)."""
    import numpy as np

    if w.ndim == 4:  # (M, C/group, kh, kw): MLAS reorders a filter to [kh][kw][C/group] per output channel
        if w.shape[1] == 1:
            return None
        return np.ascontiguousarray(w.transpose(2, 3, 1, 0)).reshape(-1, w.shape[0])
    if w.ndim != 2:
        return None
    trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0) if op in ("QGemm", "Gemm") else 0
    return w.T if trans_b else w


def u8s8_weights(path: str, shifted: bool = False) -> Iterator[object]:
    """Each weight matrix (K × N, int8) the model multiplies u8 activations by: the integer operators' (dynamic INT8,
    QOperator), and a QDQ model's, whose DequantizeLinear of s8 weights feeds a Conv/MatMul/Gemm with a u8 activation.

    ``shifted``: instead, those a QDQ model multiplies **s8** activations by. x86 runs them on the same U8S8 kernel
    with the activations moved by 128 into 0..255 (ONNX Runtime rewrites a QDQ graph's s8 activations to u8; OpenVINO's
    oneDNN shifts them), so the same pairs overflow: ORT's QDQ S8S8 MobileNetV2 scored 86.5 % top-1 on an AVX2 CPU
    against 96.9 % on a VNNI one, OpenVINO's 70.1 % against 97.3 % (qemu's EPYC-Milan, 2026-11-29). A QOperator S8S8
    product is exact there (``tests/test_avx2_kernels.py``): MLAS has signed kernels for it."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(path).graph
    init = {i.name: i for i in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}

    def array(name: str):
        return numpy_helper.to_array(init[name]) if name in init else None

    def unsigned(zero_point: str | None) -> bool:
        """An activation whose zero point is u8 (or absent: u8 is every quantizer's default)."""
        zp = array(zero_point) if zero_point else None
        return zp is None or zp.dtype == np.uint8

    def wanted(zero_point: str | None, qdq: bool) -> bool:
        return (qdq and not unsigned(zero_point)) if shifted else unsigned(zero_point)

    def arg(node, i: int | None) -> str | None:
        return node.input[i] if i is not None and len(node.input) > i and node.input[i] else None

    for node in graph.node:
        if node.op_type in INTEGER_PRODUCTS:
            w_at, zp_at = INTEGER_PRODUCTS[node.op_type]
            w = array(arg(node, w_at) or "")
            if w is None or w.dtype != np.int8 or not wanted(arg(node, zp_at), qdq=False):
                continue
        elif node.op_type in QDQ_WEIGHTED and len(node.input) > QDQ_WEIGHTED[node.op_type]:
            dq_w, dq_a = producer.get(node.input[QDQ_WEIGHTED[node.op_type]]), producer.get(node.input[0])
            if dq_w is None or dq_a is None or "DequantizeLinear" not in (dq_w.op_type, dq_a.op_type) \
                    or dq_w.op_type != dq_a.op_type:
                continue
            w = array(dq_w.input[0])
            if w is None or w.dtype != np.int8 or not wanted(arg(dq_a, 2), qdq=True):
                continue
        else:
            continue
        matrix = _reduction_major(node.op_type, w, node)
        if matrix is not None:
            yield matrix


def u8s8_overflow(path: str) -> dict[str, int | bool]:
    """How many of the model's s8 weight pairs can overflow ONNX Runtime's U8S8 kernel on x86 without VNNI.

    Dynamic quantization stretches every activation tensor over all of 0..255, and full-range per-channel weights reach
    ±127 in every column: on all-mpnet-base-v2 the clipped sums left a mean cosine of 0.0104 to fp32 (an AVX2 Zen 2)
    where 7-bit weights (``reduce_range``, at most 255 * 128 = 32640) or VNNI (32-bit sums) give 0.89; static U8S8
    lost 5.43 points on the demo MobileNetV2 on an AVX2 Zen 3 where U8U8 with 7-bit weights lost 0.54.
    ``s8s8_…``: the same count for a QDQ model's signed activations, which x86 shifts into that kernel
    (``u8s8_weights(shifted=True)``). ``safe_without_vnni``: no pair of either can overflow (u8 weights run U8U8
    kernels, 16-bit products: they never do)."""
    u8_pairs, u8_over = _count(u8s8_weights(path))
    s8_pairs, s8_over = _count(u8s8_weights(path, shifted=True))
    return {"u8s8_weight_pairs": u8_pairs, "u8s8_overflowing_pairs": u8_over, "s8s8_weight_pairs": s8_pairs,
            "s8s8_overflowing_pairs": s8_over, "safe_without_vnni": u8_over + s8_over == 0}


def _count(weights: Iterator[object]) -> tuple[int, int]:
    """(pairs, overflowing pairs) of K × N weight matrices paired along K, each side of a pair times 255."""
    import numpy as np

    pairs = overflowing = 0
    for w in weights:
        k = w.shape[0] - w.shape[0] % 2  # an odd last row is paired with zero padding: it cannot overflow
        two = w[:k].astype(np.int32).reshape(k // 2, 2, w.shape[1])
        high, low = 255 * np.clip(two, 0, None).sum(1), 255 * np.clip(two, None, 0).sum(1)
        pairs += two.shape[0] * two.shape[2]
        overflowing += int(((high > INT16_MAX) | (low < -INT16_MAX - 1)).sum())
    return pairs, overflowing


def emulate_u8s8_kernel(src: str, dst: Path, *, saturate: bool = True) -> str:
    """``src`` with every U8S8 MatMulInteger computed in float operations, so that what a CPU computes is checked on
    any CPU (slow: float products). ``saturate``: as x86's U8S8 kernel does without VNNI — the products of each pair
    of neighbours along the reduction axis summed and clipped to int16, then the activation zero point removed; else
    the exact sums a VNNI (32-bit) kernel gives, which ONNX Runtime itself returns only on a CPU with VNNI: a test
    that compares with ``InferenceSession(src)`` compares with the host's instruction set."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(src)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    nodes = []
    for n in model.graph.node:
        w = weights.get(n.input[1]) if n.op_type == "MatMulInteger" else None
        if w is None or w.dtype != np.int8:
            nodes.append(n)
            continue
        if len(n.input) > 3 and n.input[3] and weights[n.input[3]].any():
            raise ValueError(f"{n.name}: s8 weights with a zero point (ONNX Runtime's quantizers make them symmetric)")
        k, cols = w.shape
        p = f"{n.name or len(nodes)}/sat/"  # an unnamed node gets a prefix of its own

        def const(name: str, value: np.ndarray, p: str = p) -> str:
            model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), p + name))
            return p + name

        i64 = np.int64
        nodes += [
            helper.make_node("Cast", [n.input[0]], [p + "a"], to=TensorProto.FLOAT),
            helper.make_node("Reshape", [p + "a", const("shape", np.array([-1, k // 2, 2, 1], i64))], [p + "a4"]),
            helper.make_node("Mul", [p + "a4", const("w", w.astype(np.float32).reshape(k // 2, 2, cols))], [p + "products"]),
            helper.make_node("ReduceSum", [p + "products", const("pair", np.array([2], i64))], [p + "pairs"], keepdims=0),
            *([helper.make_node("Clip", [p + "pairs", const("lo", np.float32(-32768)), const("hi", np.float32(32767))],
                                [p + "int16"])] if saturate else [helper.make_node("Identity", [p + "pairs"], [p + "int16"])]),
            helper.make_node("ReduceSum", [p + "int16", const("k", np.array([1], i64))], [p + "raw"], keepdims=0),
            helper.make_node("Cast", [n.input[2] if len(n.input) > 2 and n.input[2] else const("no_zero_point", np.uint8(0))], [p + "za"],
                             to=TensorProto.FLOAT),
            helper.make_node("Mul", [p + "za", const("colsum", w.astype(np.float32).sum(0))], [p + "zero"]),
            helper.make_node("Sub", [p + "raw", p + "zero"], [p + "flat"]),
            helper.make_node("Shape", [n.input[0]], [p + "in_shape"]),
            helper.make_node("Slice", [p + "in_shape", const("s0", np.array([0], i64)), const("s1", np.array([-1], i64))], [p + "lead"]),
            helper.make_node("Concat", [p + "lead", const("n", np.array([cols], i64))], [p + "out_shape"], axis=0),
            helper.make_node("Reshape", [p + "flat", p + "out_shape"], [p + "y"]),
            helper.make_node("Cast", [p + "y"], [n.output[0]], to=TensorProto.INT32),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(dst))
    return str(dst)
