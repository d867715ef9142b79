"""OpenVINO passes: convert to IR, NNCF post-training INT8, and NNCF INT8 with accuracy control."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np

from servopt.contracts import Artifact
from servopt.cpu import Int8Kernel
from servopt.errors import UserError
from servopt.passes.base import BuildContext, Pass, PassOutput, PassParams, register_pass
from servopt.passes.nncf_onnx import OverflowFixName, overflow_fix


def _read(path: str):
    import openvino as ov

    return ov.Core().read_model(path)


def _save(model, out_dir: Path) -> PassOutput:
    import openvino as ov

    ov.save_model(model, str(out_dir / "model.xml"), compress_to_fp16=False)
    return PassOutput(format="openvino", file="model.xml")


@register_pass
class OpenVinoConvert(Pass):
    name = "openvino-convert"
    reads_data = False
    input_format = "onnx"
    output_format = "openvino"

    def run(self, artifact: Artifact, params: PassParams, out_dir: Path, ctx: BuildContext) -> PassOutput:
        import openvino as ov

        return _save(ov.convert_model(str(artifact.path)), out_dir)


def _calibration(ctx: BuildContext, count: int):
    import logging

    import nncf

    nncf.set_log_level(logging.ERROR)  # its INFO lines would interleave with servopt's progress display

    if ctx.calibration is None:
        raise UserError("NNCF quantization needs calibration data", fix="pass --data (its validation split is used)")
    # Every input of the model, one sample at a time (a text encoder has several, each cut to the sample's length).
    samples = [ctx.calibration.slice(i, i + 1) for i in range(min(count, len(ctx.calibration)))]
    return nncf.Dataset(samples)


@register_pass
class NncfQuantize(Pass):
    """``nncf.quantize``: post-training INT8 with NNCF's defaults (the figures in FIELD-NOTES used these)."""

    name = "nncf-quantize"
    input_format = "onnx"
    output_format = "openvino"

    class Params(PassParams):
        preset: Literal["performance", "mixed"] = "performance"
        subset_size: int = 100
        fast_bias_correction: bool = True
        model_type: Literal["default", "transformer"] = "default"  # transformer: NNCF's rules for attention blocks
        # NNCF's own default halves the first layer's weights only; "enable": every layer's, which cannot overflow
        # oneDNN's int16 pairs without VNNI (the catalogue asks for it for such a CPU: the demo's NNCF IR with the
        # first-layer fix lost 0.82 points on an emulated AVX2 CPU, none on the Zen 4 it was built on)
        overflow_fix: OverflowFixName = "first_layer"

    int8_recipe = True

    @classmethod
    def int8_kernel(cls, params: Params) -> Int8Kernel | None:
        """7-bit weights with the fix on every layer, 8-bit without it; NNCF's first-layer default mixes them (it held
        on a MiniLM on AVX2 kernels, lost 0.82 points on the demo CNN): not told."""
        return {"enable": "u8s8-7bit", "disable": "u8s8"}.get(params.overflow_fix)

    @classmethod
    def describe(cls, params: Params, report: dict | None = None) -> str:
        return "NNCF (OpenVINO)" + (", 7-bit weights (overflow fix)" if params.overflow_fix == "enable" else "")

    def run(self, artifact: Artifact, params: Params, out_dir: Path, ctx: BuildContext) -> PassOutput:
        import nncf
        from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters

        preset = nncf.QuantizationPreset.PERFORMANCE if params.preset == "performance" else nncf.QuantizationPreset.MIXED
        model_type = nncf.ModelType.TRANSFORMER if params.model_type == "transformer" else None
        quantized = nncf.quantize(_read(str(artifact.path)), _calibration(ctx, params.subset_size), preset=preset,
                                  subset_size=params.subset_size, fast_bias_correction=params.fast_bias_correction,
                                  model_type=model_type,
                                  advanced_parameters=AdvancedQuantizationParameters(overflow_fix=overflow_fix(params.overflow_fix)))
        return _save(quantized, out_dir)


@register_pass
class NncfAccuracyControl(Pass):
    """``nncf.quantize_with_accuracy_control``: INT8, reverting layers to float until the drop is within bound."""

    name = "nncf-accuracy-control"
    slow_seconds = 70.0  # 61-88 s on the image demo (2 AVX2 cores)
    input_format = "onnx"
    output_format = "openvino"

    class Params(PassParams):
        max_drop: float = 1.0  # accuracy points
        subset_size: int = 100

    int8_recipe = True

    @classmethod
    def describe(cls, params: Params, report: dict | None = None) -> str:
        return "NNCF (OpenVINO) with accuracy control"

    def run(self, artifact: Artifact, params: Params, out_dir: Path, ctx: BuildContext) -> PassOutput:
        import nncf

        tuning = ctx.tuning
        if tuning is None or tuning.labels is None:
            raise UserError("NNCF accuracy control needs labelled data", fix="pass --data with class folders")
        name = next(iter(tuning.inputs))
        items = [(tuning.slice(i, i + 1)[name], int(tuning.labels[i])) for i in range(len(tuning))]

        def validate(compiled, data) -> float:
            out = compiled.outputs[0]
            hits = [int(np.argmax(compiled(x)[out]) == y) for x, y in data]
            return float(np.mean(hits))

        quantized = nncf.quantize_with_accuracy_control(
            _read(str(artifact.path)), _calibration(ctx, params.subset_size), nncf.Dataset(items, lambda item: item[0]),
            validation_fn=validate, max_drop=params.max_drop / 100, drop_type=nncf.DropType.ABSOLUTE,
            subset_size=params.subset_size,
        )
        return _save(quantized, out_dir)
