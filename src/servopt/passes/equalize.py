"""Cross-layer equalization (Nagel et al., "Data-Free Quantization", 2019) of convolution chains in an ONNX graph.

When one channel of a layer's output has a range orders of magnitude above the others, a per-tensor activation
scale is set by that channel and every other channel rounds to a few levels: plain calibration loses the model.
For two layers joined by a positively homogeneous function (nothing, or ReLU: f(x/s) = f(x)/s for s > 0), dividing
channel i of the first layer's weights and bias by s_i and multiplying input channel i of the second layer's
weights by s_i leaves the model's function unchanged. With s_i = sqrt(r1_i / r2_i) (r = the channel's weight range)
both layers' channel ranges meet at sqrt(r1_i · r2_i), and the activation between them shrinks by the same s_i —
the outlier channel is brought in line before any quantizer sees it.

Written by hand: ONNX Runtime's quantization tools have no equalization, and NNCF applies its own (channel
alignment) only to OpenVINO models. ReLU6/Clip is not homogeneous (clip(x/s) ≠ clip(x)/s), so chains through it
are left alone — in MobileNetV2 that leaves the projection → expansion pairs of blocks without a residual.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from servopt.contracts import Artifact
from servopt.passes.base import BuildContext, Pass, PassOutput, PassParams, register_pass

HOMOGENEOUS = {"Relu"}  # f(x / s) = f(x) / s for s > 0


class EqualizeParams(PassParams):
    iterations: int = 2  # passes over the chains: equalizing one pair moves its neighbours' ranges
    max_scale: float = 1e4  # bound on one channel's factor: a dead channel (range 0) is left as it is


def _conv_pairs(graph) -> list[tuple[object, list[object], object]]:
    """(first Conv, homogeneous nodes between, second Conv) where the first's output reaches only the second, the
    second is a plain convolution (group 1: input channel i feeds every output), and both weights are constants."""
    inits = {t.name for t in graph.initializer}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    pairs = []
    for first in graph.node:
        if first.op_type != "Conv" or len(first.input) < 2 or first.input[1] not in inits:
            continue
        between, tensor = [], first.output[0]
        while True:
            nxt = consumers.get(tensor, [])
            if len(nxt) != 1 or tensor in outputs:
                break
            node = nxt[0]
            if node.op_type in HOMOGENEOUS:
                between.append(node)
                tensor = node.output[0]
                continue
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            if node.op_type == "Conv" and group == 1 and node.input[0] == tensor and node.input[1] in inits:
                pairs.append((first, between, node))
            break
    return pairs


def equalize(model, iterations: int = 2, max_scale: float = 1e4) -> dict:
    """Equalize every eligible Conv pair of ``model`` in place; returns what was done (pairs, largest factor)."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    pairs = _conv_pairs(graph)
    largest = 1.0
    for _ in range(iterations):
        for first, _between, second in pairs:
            w1 = numpy_helper.to_array(inits[first.input[1]]).astype(np.float64)  # [C, in/g, k, k]
            w2 = numpy_helper.to_array(inits[second.input[1]]).astype(np.float64)  # [out, C, k, k]
            if w2.shape[1] != w1.shape[0]:
                continue
            r1 = np.abs(w1.reshape(w1.shape[0], -1)).max(axis=1)
            r2 = np.abs(np.moveaxis(w2, 1, 0).reshape(w2.shape[1], -1)).max(axis=1)
            with np.errstate(divide="ignore", invalid="ignore"):
                s = np.sqrt(r1 / r2)
            s = np.where(np.isfinite(s) & (s > 1 / max_scale) & (s < max_scale), s, 1.0)
            largest = max(largest, float(np.max(np.maximum(s, 1 / s))))
            shape1 = (-1,) + (1,) * (w1.ndim - 1)
            shape2 = (1, -1) + (1,) * (w2.ndim - 2)
            _replace(inits, first.input[1], w1 / s.reshape(shape1))
            _replace(inits, second.input[1], w2 * s.reshape(shape2))
            if len(first.input) > 2 and first.input[2] in inits:
                _replace(inits, first.input[2], numpy_helper.to_array(inits[first.input[2]]).astype(np.float64) / s)
    return {"pairs": len(pairs), "iterations": iterations, "largest_factor": round(largest, 3),
            "layers": [[first.name, second.name] for first, _, second in pairs]}


def _replace(inits: dict, name: str, values: np.ndarray) -> None:
    from onnx import numpy_helper

    old = inits[name]
    old.CopyFrom(numpy_helper.from_array(values.astype(numpy_helper.to_array(old).dtype), name))


@register_pass
class Equalize(Pass):
    """Cross-layer equalization of Conv → (ReLU) → Conv chains: the same function, channel ranges evened out."""

    name = "equalize"
    reads_data = False  # data-free: weights alone
    input_format = "onnx"
    output_format = "onnx"
    Params = EqualizeParams
    int8_recipe = True  # evens out the ranges a quantizer then keeps

    @classmethod
    def describe(cls, params: EqualizeParams, report: dict | None = None) -> str:
        return "cross-layer equalization"

    def run(self, artifact: Artifact, params: EqualizeParams, out_dir: Path, ctx: BuildContext) -> PassOutput:
        import onnx

        model = onnx.load(str(artifact.path))
        report = equalize(model, params.iterations, params.max_scale)
        onnx.save(model, str(out_dir / "model.onnx"))
        return PassOutput(format="onnx", file="model.onnx", report=report)
