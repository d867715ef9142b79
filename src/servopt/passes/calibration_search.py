"""A calibration search for static INT8: the quantizer settings that keep accuracy, the fastest of them first.

Plain MinMax calibration loses points on models with outlier activations; which estimate recovers them (Entropy,
a percentile, symmetric ranges, 7-bit weights where U8S8 saturates, per-tensor or per-channel weights) differs from
model to model, so this pass tries them (Olive's static-quantization search space, measured instead of guessed):
every point is quantized with ONNX Runtime's own ``quantize_static`` (activation ranges calibrated once per method
and cached), scored on the tuning split with the family's metric, and timed; the pick is the FASTEST point within
the tolerance (the most accurate of those within 5 % of it), or, when none is, the most accurate (its variant then
fails verification with its figures shown).
All points are U8S8 QOperator: the format ONNX Runtime runs fastest on x86 without fast signed kernels.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Literal

from pydantic import Field

from servopt.contracts import Artifact
from servopt.cpu import Int8Kernel
from servopt.errors import UserError
from servopt.passes.accuracy_aware import _p50_ms, _predict, _score
from servopt.passes.base import BuildContext, Pass, PassOutput, PassParams, register_pass
from servopt.passes.onnx_passes import StaticParams, preprocess_for_quantization, quantize_static_onnx

Method = Literal["MinMax", "Entropy", "Percentile"]
SPEED_TIE = 0.05  # p50s within 5 % of the fastest count as equally fast


class CalibrationSearchParams(PassParams):
    quant_format: Literal["QDQ", "QOperator"] = "QOperator"
    activation_type: Literal["U8", "S8"] = "U8"
    max_drop: float = 1.0  # accuracy points on the tuning split
    methods: list[Method] = Field(default_factory=lambda: ["MinMax", "Entropy", "Percentile"])
    percentiles: list[float] = Field(default_factory=lambda: [99.9, 99.99, 99.999])
    symmetric_activations: list[bool] = Field(default_factory=lambda: [False, True])
    per_channel: list[bool] = Field(default_factory=lambda: [True])
    try_reduce_range: bool = False  # also 7-bit weights (x86 without VNNI, where U8S8 saturates)
    calibration_samples: int = 100
    max_points: int = 16
    timing_runs: int = 40


def search_space(params: CalibrationSearchParams) -> list[dict]:
    """The points tried, in order: cheap estimates first (MinMax, then percentiles, then Entropy's histograms)."""
    methods = [(m, p) for m in params.methods for p in (params.percentiles if m == "Percentile" else [None])]
    methods.sort(key=lambda mp: ["MinMax", "Percentile", "Entropy"].index(mp[0]))
    ranges = [False, True] if params.try_reduce_range else [False]
    points = [{"calibrate_method": m, "percentile": p, "symmetric": sym, "per_channel": pc, "reduce_range": rr}
              for (m, p), sym, pc, rr in itertools.product(methods, params.symmetric_activations, params.per_channel, ranges)]
    return points[: params.max_points]


@register_pass
class CalibrationSearch(Pass):
    name = "ort-quantize-calibration-search"
    slow_seconds = 220.0  # 236 s on the image demo (2 AVX2 cores)
    times_itself = True
    input_format = "onnx"
    output_format = "onnx"
    Params = CalibrationSearchParams
    int8_recipe = True

    @classmethod
    def int8_kernel(cls, params: CalibrationSearchParams) -> Int8Kernel:
        """Its candidates are U8S8 in 8 bits unless 7-bit weights are among them (which the search may not pick)."""
        return "s8s8" if params.activation_type == "S8" else "u8s8" if not params.try_reduce_range else "u8s8-7bit"

    @classmethod
    def describe(cls, params: CalibrationSearchParams, report: dict | None = None) -> str:
        """How many points it tried and which it chose, from its build report."""
        report = report or {}
        chosen = report.get("chosen") or {}
        return f"calibration search over {len(report.get('points', []))} points → " + (
            f"{chosen.get('calibrate_method')}{' ' + str(chosen['percentile']) if chosen.get('percentile') else ''}"
            f"{', symmetric' if chosen.get('symmetric') else ''}{', 7-bit weights' if chosen.get('reduce_range') else ''}"
            if chosen else "?") + ("" if report.get("within_tolerance", True) else " (none within tolerance)")

    def run(self, artifact: Artifact, params: CalibrationSearchParams, out_dir: Path, ctx: BuildContext) -> PassOutput:
        tuning = ctx.tuning or ctx.calibration
        if tuning is None or ctx.calibration is None:
            raise UserError("the calibration search needs data", fix="pass --data (its validation split is used)")
        src = preprocess_for_quantization(str(artifact.path), out_dir)
        float_out = _predict(src, tuning)
        score_of = ctx.family.tuning_score
        ref = score_of(float_out, tuning, float_out)
        points = []
        for i, point in enumerate(search_space(params)):
            static = StaticParams(quant_format=params.quant_format, activation_type=params.activation_type, weight_type="S8",
                                  per_channel=point["per_channel"], calibrate_method=point["calibrate_method"],
                                  calibration_samples=params.calibration_samples, reduce_range=point["reduce_range"])
            path = out_dir / f"point-{i}.onnx"
            # Ranges depend on the method, its percentile and the symmetry: calibrated once per such triple, then cached.
            cache = out_dir / f"calibration_{point['calibrate_method']}_{point['percentile']}_{point['symmetric']}.json"
            quantize_static_onnx(src, path, static, ctx.calibration, cache, percentile=point["percentile"],
                                 symmetric=point["symmetric"])
            score = _score(str(path), tuning, float_out, score_of)
            point = {**point, "score": score, "drop_points": (ref - score) * 100,
                     "within_tolerance": (ref - score) * 100 <= params.max_drop + 1e-9, "path": str(path)}
            points.append(point)
            ctx.log(f"calibration search point {i}: {point['calibrate_method']} {point['percentile'] or ''} "
                    f"drop {point['drop_points']:.2f} points")
        passing = [p for p in points if p["within_tolerance"]]
        for p in passing or points:
            p["p50_ms"] = _p50_ms(p["path"], tuning, params.timing_runs)
        if passing:
            # Every point is the same INT8 format, so their p50s differ mostly by noise: among the points within
            # SPEED_TIE of the fastest, the most accurate (a margin on the tuning split carries to unseen data better).
            fastest = min(p["p50_ms"] for p in passing)
            best = max((p for p in passing if p["p50_ms"] <= fastest * (1 + SPEED_TIE)), key=lambda p: p["score"])
        else:
            best = max(points, key=lambda p: p["score"])
        Path(best["path"]).rename(out_dir / "model.onnx")
        for p in points:
            Path(p.pop("path")).unlink(missing_ok=True)
        for f in [*out_dir.glob("calibration_*.json"), out_dir / "preprocessed.onnx", out_dir / "no_value_info.onnx"]:
            f.unlink(missing_ok=True)
        chosen = {k: best[k] for k in ("calibrate_method", "percentile", "symmetric", "per_channel", "reduce_range")}
        return PassOutput(format="onnx", file="model.onnx", report={
            "reference_score": ref, "metric": ctx.family.tuning_metric(tuning), "tolerance_points": params.max_drop,
            "points": points, "chosen": chosen, "within_tolerance": bool(passing)})
