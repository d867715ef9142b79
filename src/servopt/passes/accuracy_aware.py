"""Accuracy-aware INT8: quantize as much as possible while losing at most X of accuracy.

Intel Neural Compressor's ``tolerable_loss`` did this for ONNX until its ONNX
support went away; it also returned the first configuration that met the
tolerance. This pass:

1. quantizes everything, once per calibration method (MinMax, Entropy,
   Percentile: ranges calibrated once each and cached); if any meets the
   tolerance, full INT8 it is, and the fallback below starts from the best;
2. otherwise ranks layers by sensitivity, measured: for each weighted layer,
   how much of INT8's output error (against float, on tuning samples)
   disappears when that layer (and its input chain) stays float. Activation
   ranges are calibrated once (ONNX Runtime's calibration cache), so a probe
   costs about a second. (Per-tensor SQNR from ORT's QDQ debugging tools was
   tried first: it misses an outlier channel that wrecks a tensor's range,
   since the outlier itself keeps the SQNR high.);
   Then the most sensitive few are TIMED in float one at a time (what each float
   island costs: a unit early in the network, on the largest tensors, or one
   that breaks a chain of fused INT8 kernels with Quantize/Dequantize and layout
   reorders, can cost more than the rest of the model), and ranked by error
   removed per millisecond lost: the cheapest accuracy first.
3. falls back the k best-ranked layers to float, k = 1, 2, 4, … until the
   tolerance holds, then bisects for the smallest such k; with ``try_nncf`` the
   full-INT8 attempts include NNCF's range estimation + bias correction on the
   ONNX graph (``nncf-quantize-onnx``), and the fallback starts from whichever
   base scored best (NNCF keeps the float layers through its ignored scope);
4. times EVERY candidate within tolerance and returns the FASTEST one (fewer
   float layers is usually, not always, faster: each float island adds
   quantize/dequantize pairs).

The tolerance is judged on the tuning set (the validation split), never on the
evaluation split the final figures come from. Without labels, top-1 agreement
with the float model is the metric.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from servopt.bench.protocol import batch_consistency, predict_all
from servopt.bench.stats import timed_loop
from servopt.contracts import Artifact
from servopt.cpu import Int8Kernel
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.passes.base import BuildContext, Pass, PassOutput, register_pass
from servopt.passes.onnx_passes import DYNAMIC_EXTRA, QTYPES, StaticParams, preprocess_for_quantization, quantize_static_onnx
from servopt.runtimes import open_session

WEIGHTED = {"Conv", "Gemm", "MatMul", "ConvTranspose", "Attention"}


class AccuracyAwareParams(StaticParams):
    # static: weights and activations calibrated ahead (CNNs); dynamic: activations quantized at run time (transformers)
    mode: Literal["static", "dynamic"] = "static"
    max_drop: float = 1.0  # accuracy points (absolute) or a fraction of the reference (relative)
    drop_type: Literal["absolute", "relative"] = "absolute"
    max_steps: int = 10
    sensitivity_samples: int = 128  # tuning samples the per-layer probe compares outputs on
    try_calibrations: list[Literal["MinMax", "Entropy", "Percentile"]] = Field(default_factory=lambda: ["Entropy", "Percentile"])
    timing_runs: int = 60
    try_nncf: bool = True  # static mode: NNCF PTQ on the ONNX graph as one more full-INT8 base
    cost_probe: int = 8  # the most sensitive units timed in float, to rank by error removed per millisecond


def _predict(path: str, data: Dataset, batch: int = 64) -> np.ndarray:
    return predict_all(open_session(Artifact(format="onnx", path=path), "onnxruntime"), data, batch)


def _score(path: str, data: Dataset, float_out: np.ndarray, score_of) -> float:
    """The family's tuning score; for variable-length inputs never above the mean batch consistency (a dynamic INT8 mix
    whose outputs depend on what a sample is batched with would fail verification, so it must not pass here)."""
    session = open_session(Artifact(format="onnx", path=path), "onnxruntime")
    out = predict_all(session, data, 64)
    score = score_of(out, data, float_out)
    if data.lengths is not None:
        score = min(score, batch_consistency(session, data, 64)[0])
    return score


def _p50_ms(path: str, data: Dataset, runs: int) -> float:
    """A quick single-sample median to rank the search's candidates (the sweep measures the chosen one properly)."""
    session = open_session(Artifact(format="onnx", path=path), "onnxruntime")
    feeds = [session.prepare(data.slice(i, i + 1)) for i in range(min(8, len(data)))]
    loop = timed_loop(session.run_prepared, feeds, min_runs=runs, min_seconds=0.0, warmup=len(feeds))
    return float(np.median(loop.times_ns)) / 1e6


def fallback_units(model_path: str) -> list[tuple[str, list[str]]]:
    """(weighted node, the nodes to keep in float with it) for every Conv/Gemm/MatMul.

    Keeping a layer in float only helps if its INPUT is float too, so a unit is the weighted node plus the chain of
    nodes feeding it back to (and including) the previous weighted node: otherwise that node's quantized output
    (with a range set by, say, one outlier channel) still reaches this layer through Quantize/Dequantize.
    """
    import onnx

    graph = onnx.load(model_path, load_external_data=False).graph
    producer = {out: n for n in graph.node for out in n.output}
    units = []
    for node in graph.node:
        if node.op_type not in WEIGHTED or not node.name:
            continue
        unit, current = [node.name], producer.get(node.input[0])
        while current is not None and current.name not in unit:
            if current.name:
                unit.append(current.name)
            if current.op_type in WEIGHTED or not current.input:
                break
            current = producer.get(current.input[0])
        units.append((node.name, unit))
    return units


NNCF = "NNCF"  # the base quantizer named in ``calibrate_method``'s place when NNCF's PTQ is the base


def quantize(src: str, dst: Path, params: AccuracyAwareParams, calibration: Dataset | None, cache: Path | None,
             base: str = "ort") -> None:
    """INT8 of ``src`` with ``params`` (its ``nodes_to_exclude`` kept in float), statically or dynamically; ``base="nncf"``:
    NNCF's PTQ on the ONNX graph, in the format ONNX Runtime runs fast (unsigned activations for U8)."""
    if base == "nncf":
        from servopt.passes.nncf_onnx import NncfOnnxParams, nncf_quantize_onnx

        nncf_quantize_onnx(src, dst, NncfOnnxParams(
            subset_size=params.calibration_samples, activations="unsigned" if params.activation_type == "U8" else "signed",
            overflow_fix="enable" if params.reduce_range else "disable", ignored_names=params.nodes_to_exclude), calibration)
        return
    if params.mode == "static":
        quantize_static_onnx(src, dst, params, calibration, cache)
        return
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(src, str(dst), weight_type=getattr(QuantType, QTYPES[params.weight_type]), per_channel=params.per_channel,
                     reduce_range=params.reduce_range,
                     nodes_to_exclude=params.nodes_to_exclude or None, extra_options=DYNAMIC_EXTRA)


def rank_by_cost(float_path: str, ranked: list[tuple[str, list[str], float]], params: AccuracyAwareParams,
                 calibration: Dataset, timing: Dataset, work: Path, cache: Path) -> tuple[list[tuple[str, list[str], float]], list[dict]]:
    """Time the ``params.cost_probe`` most sensitive units in float one at a time and put them first, ordered by error
    removed per millisecond of p50 lost against full INT8 (a floor of 2 % of it keeps a free unit from dividing by 0)."""
    top = [r for r in ranked[: params.cost_probe] if r[2] > 0]
    if not top:
        return ranked, []

    def p50(excluded: list[str]) -> float:
        path = work / "cost-probe.onnx"
        quantize(float_path, path, params.model_copy(update={"nodes_to_exclude": excluded}), calibration, cache)
        ms = _p50_ms(str(path), timing, params.timing_runs)
        path.unlink(missing_ok=True)
        return ms

    full = p50([])
    costs = []
    for name, unit, removed in top:
        cost = p50(unit) - full
        costs.append({"layer": name, "error_removed": removed, "cost_ms": cost, "per_ms": removed / max(cost, 0.02 * full)})
    order = {c["layer"]: i for i, c in enumerate(sorted(costs, key=lambda c: -c["per_ms"]))}
    probed = sorted(top, key=lambda r: order[r[0]])
    rest = [r for r in ranked if r[0] not in order]
    return probed + rest, [{**c, "full_int8_p50_ms": full} for c in costs]


def rank_sensitivity(float_path: str, params: AccuracyAwareParams, calibration: Dataset, probe: Dataset, work: Path,
                     cache: Path, limit: int = 64) -> list[tuple[str, list[str], float]]:
    """Measure, per weighted layer, how much of INT8's output error disappears when that layer stays float.

    One quantization per layer, but the activation ranges are calibrated once (ONNX Runtime's calibration
    cache), so this costs about a second per layer. Returns (layer, unit, error removed), most sensitive first.
    """
    float_out = _predict(float_path, probe)

    def error(excluded: list[str]) -> float:
        path = work / "probe.onnx"
        quantize(float_path, path, params.model_copy(update={"nodes_to_exclude": excluded}), calibration, cache)
        out = _predict(str(path), probe)
        path.unlink(missing_ok=True)
        return float(np.mean((out - float_out) ** 2))

    base = error([])
    ranked = [(name, unit, base - error(unit)) for name, unit in fallback_units(float_path)[:limit]]
    return sorted(ranked, key=lambda r: -r[2])


@register_pass
class AccuracyAwareInt8(Pass):
    name = "ort-quantize-accuracy-aware"
    slow_seconds = 65.0  # 74 s on the image demo (2 AVX2 cores)
    times_itself = True
    input_format = "onnx"
    output_format = "onnx"
    Params = AccuracyAwareParams
    int8_recipe = True

    @classmethod
    def int8_kernel(cls, params: AccuracyAwareParams) -> Int8Kernel:
        return params.int8_kernel()

    @classmethod
    def describe(cls, params: AccuracyAwareParams, report: dict | None = None) -> str:
        """The calibration it kept and how many layers it left in float, from its build report."""
        report = report or {}
        layers = report.get("float_layers")
        return (f"accuracy-aware: {report.get('calibration', params.calibrate_method)} calibration, "
                + (f"{len(layers)} layer(s) in float" if layers else "no layer in float"))

    def run(self, artifact: Artifact, params: AccuracyAwareParams, out_dir: Path, ctx: BuildContext) -> PassOutput:
        tuning = ctx.tuning or ctx.calibration
        if tuning is None or ctx.calibration is None:
            raise UserError("accuracy-aware quantization needs data", fix="pass --data (its validation split is used)")
        src = preprocess_for_quantization(str(artifact.path), out_dir)
        float_out = _predict(src, tuning)
        score_of = ctx.family.tuning_score
        ref = score_of(float_out, tuning, float_out)
        allowed = params.max_drop / 100 if params.drop_type == "absolute" else ref * params.max_drop
        steps: list[dict] = []

        def attempt(excluded: list[str], label: str, config: AccuracyAwareParams, cache: Path, base: str = "ort") -> dict:
            """Quantize with ``config`` minus ``excluded`` (ranges calibrated once per method, cached), score it."""
            path = out_dir / f"candidate-{len(steps)}.onnx"
            quantize(src, path, config.model_copy(update={"nodes_to_exclude": excluded}), ctx.calibration, cache, base)
            score = _score(str(path), tuning, float_out, score_of)
            step = {"step": len(steps), "label": label, "calibration": NNCF if base == "nncf" else config.calibrate_method,
                    "float_layers": len(excluded), "excluded": excluded,
                    "score": score, "drop_points": (ref - score) * 100, "within_tolerance": ref - score <= allowed + 1e-12,
                    "path": str(path)}
            steps.append(step)
            ctx.log(f"accuracy-aware step {step['step']}: {len(excluded)} float layer(s), score {score:.4f}")
            return step

        # Full INT8 under each calibration method first: a better range estimate often meets the tolerance at full speed.
        base = params
        methods = [params.calibrate_method, *params.try_calibrations] if params.mode == "static" else [params.calibrate_method]
        for method in dict.fromkeys(methods):
            trial = params.model_copy(update={"calibrate_method": method})
            label = f"full INT8, {method} calibration" if params.mode == "static" else "full dynamic INT8"
            step = attempt([], label, trial, out_dir / f"calibration_cache_{method}.json")
            if step["score"] > max((s["score"] for s in steps[:-1]), default=-1.0):
                base = trial
        base_quantizer = "ort"
        if params.mode == "static" and params.try_nncf and not any(s["within_tolerance"] for s in steps):
            step = attempt([], "full INT8, NNCF range estimation + bias correction", params, out_dir / "unused", "nncf")
            if step["score"] > max(s["score"] for s in steps[:-1]):
                base_quantizer = "nncf"
        ranking: list[tuple[str, list[str], float]] = []
        costs: list[dict] = []
        cache = out_dir / f"calibration_cache_{base.calibrate_method}.json"
        if not any(s["within_tolerance"] for s in steps):
            probe = tuning.subset(np.arange(min(len(tuning), params.sensitivity_samples)))
            # Sensitivity is probed with ONNX Runtime's quantizer (ranges cached: a second a layer) whatever the base.
            ranking = rank_sensitivity(src, base, ctx.calibration, probe, out_dir, cache)
            if params.cost_probe:
                ranking, costs = rank_by_cost(src, ranking, base, ctx.calibration, tuning, out_dir, cache)

            def excluded(k: int) -> list[str]:
                return list(dict.fromkeys(n for _, unit, _ in ranking[:k] for n in unit))

            k, last_fail, first_pass = 1, 0, None
            while len(steps) < params.max_steps and k <= len(ranking):
                if attempt(excluded(k), f"{k} best-ranked layer(s) in float", base, cache, base_quantizer)["within_tolerance"]:
                    first_pass = k
                    break
                last_fail, k = k, min(k * 2, len(ranking)) if k < len(ranking) else k + 1
            while first_pass is not None and first_pass - last_fail > 1 and len(steps) < params.max_steps:
                mid = (first_pass + last_fail) // 2
                if attempt(excluded(mid), f"{mid} best-ranked layer(s) in float", base, cache, base_quantizer)["within_tolerance"]:
                    first_pass = mid
                else:
                    last_fail = mid
        passing = [s for s in steps if s["within_tolerance"]]
        if not passing:
            raise UserError(
                f"no INT8 mix within {params.max_drop} {'points' if params.drop_type == 'absolute' else 'relative'} "
                f"after {len(steps)} steps (best drop {min(s['drop_points'] for s in steps):.2f} points)",
                fix="raise the tolerance, or raise max_steps",
            )
        for s in steps:  # every step is timed (the report shows the trade-off); the pick is the fastest passing one
            s["p50_ms"] = _p50_ms(s["path"], tuning, params.timing_runs)
        best = min(passing, key=lambda s: s["p50_ms"])
        weighted_layers = len(fallback_units(src))
        Path(best["path"]).rename(out_dir / "model.onnx")
        for s in steps:
            Path(s.pop("path")).unlink(missing_ok=True)
        Path(out_dir / "preprocessed.onnx").unlink(missing_ok=True)
        for f in out_dir.glob("calibration_cache_*.json"):
            f.unlink()
        report = {"reference_score": ref, "tolerance": {"max_drop": params.max_drop, "drop_type": params.drop_type},
                  "metric": ctx.family.tuning_metric(tuning),
                  "tuning_samples": len(tuning), "steps": steps, "chosen_step": best["step"],
                  "float_layers": best["excluded"], "calibration": best["calibration"], "weighted_layers": weighted_layers,
                  "sensitivity": [{"layer": n, "unit": u, "error_removed": e} for n, u, e in ranking[:20]],
                  "float_island_costs": costs}
        return PassOutput(format="onnx", file="model.onnx", report=report)
