"""NNCF post-training INT8 applied to the ONNX graph itself: a QDQ model that ONNX Runtime (and OpenVINO) run.

Why NNCF on ONNX and not only through OpenVINO: on models that resist plain calibration (MobileNet-style depthwise
layers, per-channel ranges that differ by orders of magnitude) NNCF's range estimation plus bias correction keeps
the accuracy that ONNX Runtime's MinMax/Entropy/Percentile calibrators lose (measured on the demo MobileNetV2 trained
on an AVX2-only Zen 4: −0.27 points vs −5.4), and ONNX Runtime then runs the result with its fused INT8 kernels.

Two things NNCF does not do for ONNX Runtime on x86, done here after it:
- NNCF writes SIGNED activations (int8 zero points). ONNX Runtime's MLAS has fast S8S8 kernels only with
  AVX-VNNI-INT8 (or ARM dot product): elsewhere a signed-activation QDQ model ran 2.4× slower than fp32 (same run).
  ``activations="unsigned"`` rewrites every activation Quantize/Dequantize pair to uint8 with the zero point moved
  by +128 — the same numbers (q' = q + 128 on both sides, the clamp range shifts with it), so the U8S8 kernels run.
- x86 without VNNI computes U8S8 with ``vpmaddubsw``, whose 16-bit intermediate saturates when two 8-bit products
  add past 32767: ``overflow_fix="enable"`` makes NNCF quantize every layer's weights to 7 bits, which cannot
  overflow (ONNX Runtime's ``reduce_range`` does the same for its own quantizer). The catalogue picks it from
  ``CpuFeatures.int8_saturates``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pydantic import Field

from servopt.contracts import Artifact
from servopt.cpu import Int8Kernel
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.passes.base import BuildContext, Pass, PassOutput, PassParams, register_pass

log = logging.getLogger(__name__)


# NNCF's overflow fix by name (both NNCF passes take it): "first_layer" is NNCF's default, "enable" puts every layer's
# weights in 7 bits, which cannot overflow an int16 pair without VNNI
OverflowFixName = Literal["enable", "first_layer", "disable"]


def overflow_fix(name: OverflowFixName):
    """NNCF's ``OverflowFix`` member for ``name``."""
    from nncf.quantization.advanced_parameters import OverflowFix

    return {"enable": OverflowFix.ENABLE, "first_layer": OverflowFix.FIRST_LAYER, "disable": OverflowFix.DISABLE}[name]


class NncfOnnxParams(PassParams):
    preset: Literal["performance", "mixed"] = "performance"  # mixed: asymmetric activations (NNCF's choice for GELU/…)
    subset_size: int = 300  # calibration samples (NNCF's default; the tuning split may hold fewer)
    bias_correction: Literal["fast", "full", "none"] = "fast"
    model_type: Literal["default", "transformer"] = "default"  # transformer: SmoothQuant + NNCF's attention rules
    smooth_quant_alpha: float | None = None  # transformer only; None: NNCF's default
    overflow_fix: OverflowFixName = "first_layer"
    activations: Literal["signed", "unsigned"] = "unsigned"  # unsigned: what ONNX Runtime runs fast without VNNI-INT8
    ignored_types: list[str] = Field(default_factory=list)  # ONNX op types kept in float
    ignored_names: list[str] = Field(default_factory=list)  # node names kept in float


def nncf_quantize_onnx(src: str, dst: Path, params: NncfOnnxParams, calibration: Dataset | None) -> dict:
    """Run ``nncf.quantize`` on the ONNX model at ``src`` and save the QDQ model at ``dst``; returns the report."""
    import nncf
    import onnx
    from nncf.quantization.advanced_parameters import (
        AdvancedQuantizationParameters,
        AdvancedSmoothQuantParameters,
        QuantizationParameters,
    )

    nncf.set_log_level(logging.ERROR)
    if calibration is None:
        raise UserError("NNCF quantization needs calibration data", fix="pass --data (its validation split is used)")
    count = min(params.subset_size, len(calibration))
    samples = [calibration.slice(i, i + 1) for i in range(count)]
    model = onnx.load(src)
    names = {n.name for n in model.graph.node}
    ignored = nncf.IgnoredScope(types=params.ignored_types, names=[n for n in params.ignored_names if n in names],
                                validate=False)
    advanced = AdvancedQuantizationParameters(
        overflow_fix=overflow_fix(params.overflow_fix),
        disable_bias_correction=params.bias_correction == "none",
        # NNCF's CPU rules quantize depthwise convolutions' inputs per channel; ONNX Runtime's QLinearConv takes one
        # activation scale, so such a convolution would run in float between Quantize/Dequantize pairs (slower than fp32).
        activations_quantization_params=QuantizationParameters(per_channel=False),
        **({"smooth_quant_alphas": AdvancedSmoothQuantParameters(matmul=params.smooth_quant_alpha)}
           if params.smooth_quant_alpha is not None else {}),
    )
    quantized = nncf.quantize(
        model, nncf.Dataset(samples), subset_size=count,
        preset=nncf.QuantizationPreset.PERFORMANCE if params.preset == "performance" else nncf.QuantizationPreset.MIXED,
        fast_bias_correction=params.bias_correction != "full",
        model_type=nncf.ModelType.TRANSFORMER if params.model_type == "transformer" else None,
        ignored_scope=ignored, advanced_parameters=advanced,
    )
    rewritten = unsigned_activations(quantized) if params.activations == "unsigned" else 0
    onnx.save(quantized, str(dst))
    return {"calibration_samples": count, "bias_correction": params.bias_correction, "overflow_fix": params.overflow_fix,
            "activations": params.activations, "activation_quantizers_made_unsigned": rewritten,
            "float_layers": sorted(set(params.ignored_names) & names)}


def unsigned_activations(model) -> int:
    """Rewrite int8 ACTIVATION Quantize/DequantizeLinear pairs to uint8 (zero point + 128): numerically the same model,
    run by ONNX Runtime's U8S8 kernels. Weights (Quantize/Dequantize of an initializer) stay int8. Returns how many
    quantizers were rewritten. Written by hand: neither NNCF nor ONNX Runtime offers this conversion."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    new_inits: dict = {}
    rewritten: set[str] = set()

    def shifted(name: str) -> str | None:
        tensor = inits.get(name)
        if tensor is None or tensor.data_type != TensorProto.INT8:
            return None
        if name not in new_inits:
            values = numpy_helper.to_array(tensor).astype(np.int16) + 128
            new_inits[name] = numpy_helper.from_array(values.astype(np.uint8), name + "_u8")
        return name + "_u8"

    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in inits or len(node.input) < 3:
            continue
        dqs = [c for c in consumers.get(node.output[0], []) if c.op_type == "DequantizeLinear"]
        if len(dqs) != len(consumers.get(node.output[0], [])):
            continue  # a quantized tensor read by something else keeps its type
        zp = shifted(node.input[2])
        if zp is None:
            continue
        node.input[2] = zp
        for dq in dqs:
            if len(dq.input) >= 3 and (dq_zp := shifted(dq.input[2])) is not None:
                dq.input[2] = dq_zp
        rewritten.add(node.output[0])
    graph.initializer.extend(new_inits.values())
    used = {name for node in graph.node for name in node.input}
    stale = [t for t in graph.initializer if t.name not in used]
    for t in stale:  # the int8 zero points nothing reads any more
        graph.initializer.remove(t)
    for info in graph.value_info:  # the rewritten quantizers' outputs are uint8 now
        if info.name in rewritten and info.type.tensor_type.elem_type == TensorProto.INT8:
            info.type.tensor_type.elem_type = TensorProto.UINT8
    return len(rewritten)


@register_pass
class NncfQuantizeOnnx(Pass):
    """``nncf.quantize`` on the ONNX graph (range estimation + bias correction; SmoothQuant for transformers), activations
    made unsigned for ONNX Runtime's fast kernels, 7-bit weights where U8S8 would saturate."""

    name = "nncf-quantize-onnx"
    input_format = "onnx"
    output_format = "onnx"
    Params = NncfOnnxParams
    int8_recipe = True

    @classmethod
    def int8_kernel(cls, params: NncfOnnxParams) -> Int8Kernel:
        if params.activations == "signed":
            return "s8s8"
        return "u8s8-7bit" if params.overflow_fix == "enable" else "u8s8"

    @classmethod
    def describe(cls, params: NncfOnnxParams, report: dict | None = None) -> str:
        """What it did to keep accuracy beyond range estimation: bias correction, the mixed preset, SmoothQuant, 7-bit
        weights, activations made unsigned."""
        bc = params.bias_correction
        return ("NNCF range estimation" + (f" + {bc} bias correction" if bc != "none" else "")
                + (", mixed preset" if params.preset == "mixed" else "")
                + (", SmoothQuant" if params.model_type == "transformer" else "")
                + (", 7-bit weights (overflow fix)" if params.overflow_fix == "enable" else "")
                + (", activations made unsigned for ONNX Runtime's U8S8 kernels" if params.activations == "unsigned" else ""))

    def run(self, artifact: Artifact, params: NncfOnnxParams, out_dir: Path, ctx: BuildContext) -> PassOutput:
        from servopt.passes.onnx_passes import preprocess_for_quantization

        src = preprocess_for_quantization(str(artifact.path), out_dir)
        report = nncf_quantize_onnx(src, out_dir / "model.onnx", params, ctx.calibration)
        Path(out_dir / "preprocessed.onnx").unlink(missing_ok=True)
        return PassOutput(format="onnx", file="model.onnx", report=report)
