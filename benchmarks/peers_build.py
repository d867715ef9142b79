"""Build one INT8 peer of servopt's pick: the tools a user would reach for instead, run as documented.

Runs INSIDE the peers' own environment (never servopt's: ``benchmarks/peers_int8.py`` creates it with
``servopt.envs.ensure_env`` and runs this file once per peer with that environment's Python), so Optimum, Olive,
transformers and torch never touch servopt's venv, while ONNX Runtime is pinned to servopt's version. It imports
nothing from servopt.

Every peer starts from the same fp32 ONNX model and the same calibration images (``calib.npz``, written by
peers_int8.py from the run's validation split exactly as ``servopt optimize`` chose them). Each peer is configured
with its library's documented defaults, nothing weaker; ``result.json`` says exactly which configuration it used.

Peers (``--peer``):

- ``optimum-avx2-minmax``, ``optimum-avx2-percentiles``, ``optimum-avx512vnni-minmax``,
  ``optimum-avx512vnni-percentiles``, and with ``-entropy`` in place of the calibration name the same with Entropy:
  Optimum's ``ORTQuantizer`` (optimum-onnx) with ``AutoQuantizationConfig.avx2(is_static=True)`` or
  ``.avx512_vnni(is_static=True)`` and ``AutoCalibrationConfig.minmax`` / ``.percentiles`` / ``.entropy`` (all
  other arguments at their defaults), the calibration images as a ``datasets.Dataset``, ``fit`` then ``quantize`` as in
  Optimum's quantization guide.
- ``nncf-onnx-defaults``, ``nncf-onnx-accuracy-control``: NNCF on the ONNX graph, ``nncf.quantize`` with its defaults
  and ``nncf.quantize_with_accuracy_control`` (1 point of top-1 on the validation split), QDQ models run by ONNX Runtime.
- ``olive-static-defaults``: Olive's ``OnnxStaticQuantization`` pass with every option at its default, run through
  ``olive.workflows.run`` on the local ONNX file, calibration from a user dataset (``servopt_npz``, registered below).
- ``olive-static-search``: the same pass with Olive's own search space for it (every option that declares
  ``search_defaults``: quant_format, precision and activation_type, per_channel, reduce_range, quant_preprocess,
  calibrate_method: 72 valid points), Olive's joint search with the sampler the ``olive`` CLI uses by default
  (``sequential``), and objectives that pick what servopt picks: the lowest latency (Olive's ``latency`` metric, avg
  of its default 20 runs, priority 1) among the models within 1 point of the fp32 model's accuracy (``accuracy_score``
  on the validation split, priority 2, goal ``max-degradation 0.01``). Olive's best candidate is the result; every
  point it tried is in result.json. ``--olive-samples N`` stops the search after N points of the space, invalid ones
  included (Olive counts them; sampler_config's max_samples is lost inside olive.workflows.run, so max_iter does it).

    <peers env python> benchmarks/peers_build.py --peer optimum-avx2-minmax --model fp32.onnx \\
        --calib calib.npz --tuning tuning.npz --out work/peers/optimum-avx2-minmax

(peers_int8.py passes these; a result.json with status "ok" and the model's path, or "failed" and the error, is
always written, even when the build crashes in Python.)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import numpy as np

OPTIMUM_ISAS = {"avx2": "avx2", "avx512vnni": "avx512_vnni"}
OPTIMUM_CALIBRATIONS = ("minmax", "percentiles", "entropy")
OLIVE_PEERS = ("olive-static-defaults", "olive-static-search")
NNCF_PEERS = ("nncf-onnx-defaults", "nncf-onnx-accuracy-control")
PEERS = tuple(f"optimum-{isa}-{cal}" for isa in OPTIMUM_ISAS for cal in OPTIMUM_CALIBRATIONS) + OLIVE_PEERS + NNCF_PEERS
OLIVE_DATASET = "servopt_npz"
OLIVE_ARGMAX = "servopt_argmax"


def read_npz(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """(named inputs, labels) from the .npz peers_int8.py writes: ``input:<name>`` arrays and ``labels``."""
    with np.load(path) as z:
        inputs = {k.removeprefix("input:"): z[k] for k in z.files if k.startswith("input:")}
        labels = z["labels"] if "labels" in z.files else None
    return inputs, labels


# ------------------------------------------------------------------------------------------------------ Optimum


def build_optimum(peer: str, model: Path, calib: Path, out: Path) -> dict:
    from datasets import Dataset as HFDataset
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoCalibrationConfig, AutoQuantizationConfig

    _, isa, calibration = peer.split("-")
    inputs, _labels = read_npz(calib)
    # One row per calibration image, as a Hugging Face dataset: what ORTQuantizer.fit takes. numpy format so each row
    # reaches ONNX Runtime as float32 (the default python-list format would arrive as float64).
    dataset = HFDataset.from_dict({name: list(arr) for name, arr in inputs.items()}).with_format("numpy")
    qconfig = getattr(AutoQuantizationConfig, OPTIMUM_ISAS[isa])(is_static=True)  # every other argument: default
    ccfg = getattr(AutoCalibrationConfig, calibration)(dataset)  # default bins / percentile / moving average
    quantizer = ORTQuantizer.from_pretrained(model.parent, file_name=model.name)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ranges = quantizer.fit(dataset=dataset, calibration_config=ccfg, onnx_augmented_model_name=out / "augmented_model.onnx",
                           operators_to_quantize=qconfig.operators_to_quantize)
    calib_s = time.perf_counter() - t0
    save_dir = quantizer.quantize(save_dir=out / "model", quantization_config=qconfig, calibration_tensors_range=ranges)
    (out / "augmented_model.onnx").unlink(missing_ok=True)
    produced = sorted(Path(save_dir).glob("*.onnx"))
    if len(produced) != 1:
        raise RuntimeError(f"ORTQuantizer.quantize left {len(produced)} .onnx files in {save_dir}, expected 1")
    ort_config = json.loads((Path(save_dir) / "ort_config.json").read_text()) if (Path(save_dir) / "ort_config.json").exists() else None
    return {
        "path": str(produced[0]),
        "calibration_s": round(calib_s, 2),
        "configuration": {
            "tool": "optimum-onnx ORTQuantizer",
            "call": f"AutoQuantizationConfig.{OPTIMUM_ISAS[isa]}(is_static=True); AutoCalibrationConfig.{calibration}(dataset); "
                    "quantizer.fit(dataset, calibration_config, operators_to_quantize=qconfig.operators_to_quantize); "
                    "quantizer.quantize(quantization_config=qconfig, calibration_tensors_range=ranges)",
            "format": qconfig.format.name, "mode": qconfig.mode.name,
            "activations": qconfig.activations_dtype.name, "activations_symmetric": qconfig.activations_symmetric,
            "weights": qconfig.weights_dtype.name, "weights_symmetric": qconfig.weights_symmetric,
            "per_channel": qconfig.per_channel, "reduce_range": qconfig.reduce_range,
            "operators_to_quantize": [getattr(op, "value", op) for op in qconfig.operators_to_quantize],
            "calibration": {"method": ccfg.method.name, "samples": len(dataset),
                            **{k: getattr(ccfg, k) for k in ("moving_average", "averaging_constant", "num_bins",
                                                             "num_quantized_bins", "percentile") if getattr(ccfg, k, None) is not None}},
            "ort_config_json": ort_config,
        },
    }


# --------------------------------------------------------------------------------------------------------- NNCF


def build_nncf(peer: str, model: Path, calib: Path, tuning: Path, out: Path) -> dict:
    """NNCF on the ONNX model as its documentation shows: ``nncf.quantize`` with every option at its default, or
    ``nncf.quantize_with_accuracy_control`` (max_drop 0.01 absolute top-1 on the validation split); the QDQ model it
    writes is what a user hands to ONNX Runtime."""
    import nncf
    import onnx
    import onnxruntime as ort

    inputs, _ = read_npz(calib)
    name = next(iter(inputs))
    calibration = nncf.Dataset([{k: v[i:i + 1] for k, v in inputs.items()} for i in range(len(inputs[name]))])
    fp32 = onnx.load(str(model))
    out.mkdir(parents=True, exist_ok=True)
    call = "nncf.quantize(model, nncf.Dataset(calibration))"
    if peer == "nncf-onnx-defaults":
        quantized = nncf.quantize(fp32, calibration)
    else:
        val_inputs, labels = read_npz(tuning)
        items = [({k: v[i:i + 1] for k, v in val_inputs.items()}, int(labels[i])) for i in range(len(labels))]

        def validate(candidate, data) -> float:
            session = ort.InferenceSession(candidate.SerializeToString(), providers=["CPUExecutionProvider"])
            return float(np.mean([int(np.argmax(session.run(None, x)[0]) == y) for x, y in data]))

        quantized = nncf.quantize_with_accuracy_control(fp32, calibration, nncf.Dataset(items), validation_fn=validate,
                                                         max_drop=0.01, drop_type=nncf.DropType.ABSOLUTE)
        call = ("nncf.quantize_with_accuracy_control(model, calibration, validation, validate (top-1 in ONNX Runtime), "
                "max_drop=0.01, drop_type=ABSOLUTE)")
    path = out / "model.onnx"
    onnx.save(quantized, str(path))
    return {"path": str(path), "configuration": {"tool": f"nncf {nncf.__version__} (ONNX backend)", "call": call,
                                                 "calibration_samples": len(inputs[name])}}


# -------------------------------------------------------------------------------------------------------- Olive


def _register_olive_components() -> None:
    """The user dataset and the argmax post-processing, registered when Olive imports this file as its user_script."""
    try:
        from olive.data.registry import Registry
    except ImportError:
        return

    @Registry.register_dataset(OLIVE_DATASET)
    def npz_dataset(data_path: str, **_kwargs):
        import torch

        inputs, labels = read_npz(Path(data_path))
        names = list(inputs)
        count = len(inputs[names[0]])
        targets = labels if labels is not None else np.zeros(count, dtype=np.int64)

        class NpzDataset(torch.utils.data.Dataset):
            def __len__(self) -> int:
                return count

            def __getitem__(self, i: int):
                return {n: torch.from_numpy(inputs[n][i]) for n in names}, int(targets[i])

        return NpzDataset()

    @Registry.register_post_process(OLIVE_ARGMAX)
    def argmax(output_data, **_kwargs):
        import torch

        logits = output_data if isinstance(output_data, torch.Tensor) else torch.as_tensor(np.asarray(output_data))
        return logits.argmax(dim=-1)


def _olive_data_config(name: str, path: Path, batch_size: int) -> dict:
    return {"name": name, "type": "DataContainer", "user_script": str(Path(__file__).resolve()),
            "load_dataset_config": {"type": OLIVE_DATASET, "params": {"data_path": str(path)}},
            "post_process_data_config": {"type": OLIVE_ARGMAX},
            "dataloader_config": {"batch_size": batch_size}}


def build_olive(peer: str, model: Path, calib: Path, tuning: Path, out: Path, samples: int, sampler: str,
                num_classes: int) -> dict:
    import olive
    from olive.workflows import run as olive_run

    search = peer == "olive-static-search"
    out.mkdir(parents=True, exist_ok=True)
    local = {"type": "LocalSystem", "accelerators": [{"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}]}
    config: dict = {
        "input_model": {"type": "ONNXModel", "model_path": str(model)},
        "systems": {"local_system": local},
        "data_configs": [_olive_data_config("calibration", calib, 1)],
        "passes": {"quantization": {"type": "OnnxStaticQuantization", "data_config": "calibration"}},
        "host": "local_system", "target": "local_system",
        "cache_dir": str(out / "cache"), "output_dir": str(out / "output"),
        "evaluate_input_model": False, "log_severity_level": 2,
    }
    if search:
        config["data_configs"].append(_olive_data_config("validation", tuning, 16))
        # "type" is required in practice: without it Olive 0.13 crashes (AttributeError in find_all_resources)
        config["evaluators"] = {"latency_then_accuracy": {"type": "OnnxEvaluator", "metrics": [
            {"name": "latency", "type": "latency", "data_config": "calibration",
             "sub_types": [{"name": "avg", "priority": 1}]},
            {"name": "accuracy", "type": "accuracy", "data_config": "validation",
             "sub_types": [{"name": "accuracy_score", "priority": 2,
                            "metric_config": {"task": "multiclass", "num_classes": num_classes},
                            "goal": {"type": "max-degradation", "value": 0.01}}]},
        ]}}
        config["evaluator"] = "latency_then_accuracy"
        config["evaluate_input_model"] = True  # the accuracy goal is a degradation from the input model
        # Olive 0.13's workflow runner drops sampler_config (max_samples, seed) on its way to the engine (a pydantic
        # field typed as the bare ConfigBase dumps as {}), so the bound on points tried is max_iter, which counts
        # invalid points of the space too (e.g. QOperator with S8 activations).
        config["search_strategy"] = {"execution_order": "joint", "sampler": sampler,
                                     "sampler_config": {"max_samples": samples, **({"seed": 0} if sampler != "sequential" else {})},
                                     "max_iter": samples - 1 if samples > 0 else None}  # stops once count > max_iter
    requested = copy.deepcopy(config)  # olive_run replaces parts of the dict it is given with its parsed objects
    t0 = time.perf_counter()
    output = olive_run(config)
    run_s = time.perf_counter() - t0
    best = output.get_best_candidate() if output is not None else None
    footprint = _olive_footprint(out / "output")
    if best is None:
        if not search:
            raise RuntimeError("Olive produced no output model")
        points = _olive_points(footprint)
        raise OliveNoCandidate(
            f"Olive's search made {len(points)} model(s) and none met its goal (accuracy within 0.01 of the input "
            f"model's on the validation split): "
            + "; ".join(f"{_describe(p['params'])}: {p['metrics']}" for p in points), points)
    path = Path(best.model_path)
    if path.is_dir():
        onnx_files = sorted(path.glob("*.onnx"))
        if len(onnx_files) != 1:
            raise RuntimeError(f"Olive's output folder {path} holds {len(onnx_files)} .onnx files")
        path = onnx_files[0]
    used = dict((footprint.get(best.model_id) or {}).get("pass_run_config") or {})
    used.pop("data_config", None)
    result = {"path": str(path), "olive_run_s": round(run_s, 1), "configuration": {
        "tool": f"olive-ai {getattr(olive, '__version__', '?')} OnnxStaticQuantization via olive.workflows.run",
        "pass_config_requested": requested["passes"]["quantization"],
        "pass_config_used": used or None,
        "calibration_samples": len(read_npz(calib)[1]),
    }}
    if search:
        result["configuration"]["search"] = {
            "space": "Olive's search_defaults of OnnxStaticQuantization (quant_format, precision/activation_type, "
                     "per_channel, reduce_range, quant_preprocess, calibrate_method)",
            "strategy": requested["search_strategy"], "objectives": requested["evaluators"]["latency_then_accuracy"],
            "accuracy_data": f"validation split ({len(read_npz(tuning)[1])} images)",
        }
        result["configuration"]["best_metrics"] = _jsonable(best.metrics_value)
        result["configuration"]["input_model_metrics"] = _jsonable(output.get_input_model_metrics())
        result["search_points"] = _olive_points(footprint)
    return result


class OliveNoCandidate(RuntimeError):
    """Olive's search ran but no model met its goals; carries the points it tried."""

    def __init__(self, message: str, points: list[dict]) -> None:
        super().__init__(message)
        self.points = points


def _describe(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


SEARCHED = ("quant_format", "precision", "activation_type", "per_channel", "reduce_range", "quant_preprocess",
            "calibrate_method")


def _olive_footprint(output_dir: Path) -> dict:
    """Olive's footprint.json: model id -> node (parent, the pass's run configuration, metrics, Pareto flag)."""
    try:
        return json.loads((output_dir / "footprint.json").read_text())
    except (OSError, ValueError):
        return {}


def _olive_points(footprint: dict) -> list[dict]:
    """Every model Olive made, with the quantization parameters it ran with and the metrics it measured."""
    points = []
    for model_id, node in footprint.items():
        cfg = node.get("pass_run_config")
        if not cfg:
            continue  # the input model
        metrics = (node.get("metrics") or {}).get("value") or {}
        points.append({"model_id": model_id, "params": {k: cfg.get(k) for k in SEARCHED},
                       "metrics": {k: (v.get("value") if isinstance(v, dict) else v) for k, v in metrics.items()},
                       "pareto_frontier": node.get("is_pareto_frontier")})
    return points


def _jsonable(obj):
    try:
        return json.loads(json.dumps(obj, default=str))
    except (TypeError, ValueError):
        return str(obj)


# --------------------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", required=True, choices=PEERS)
    ap.add_argument("--model", type=Path, required=True, help="the fp32 ONNX model")
    ap.add_argument("--calib", type=Path, required=True, help="calibration .npz (input:<name> arrays, labels)")
    ap.add_argument("--tuning", type=Path, required=True, help="validation-split .npz for Olive's accuracy objective")
    ap.add_argument("--out", type=Path, required=True, help="this peer's folder; result.json is written there")
    ap.add_argument("--num-classes", type=int, default=0)
    ap.add_argument("--olive-samples", type=int, default=0,
                    help="search points Olive may try, invalid ones of its space counted (0: the whole space)")
    ap.add_argument("--olive-sampler", default="sequential", choices=["sequential", "random", "tpe"])
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OLIVE_DISABLE_TELEMETRY", "1")
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    result: dict = {"peer": args.peer, "status": "failed", "python": sys.version.split()[0]}
    t0 = time.perf_counter()
    try:
        if args.peer.startswith("optimum-"):
            result.update(build_optimum(args.peer, args.model.resolve(), args.calib.resolve(), out))
        elif args.peer in NNCF_PEERS:
            result.update(build_nncf(args.peer, args.model.resolve(), args.calib.resolve(), args.tuning.resolve(), out))
        else:
            num_classes = args.num_classes or int(read_npz(args.tuning)[1].max()) + 1
            result.update(build_olive(args.peer, args.model.resolve(), args.calib.resolve(), args.tuning.resolve(), out,
                                      args.olive_samples, args.olive_sampler, num_classes))
        result["status"] = "ok"
        result["size_mb"] = round(sum(p.stat().st_size for p in Path(result["path"]).parent.glob(Path(result["path"]).name + "*")) / 1e6, 3)
    except BaseException as e:  # noqa: BLE001 - any failure is reported in result.json, and the other peers go on
        result["error"] = f"{type(e).__name__}: {e}"
        if isinstance(e, OliveNoCandidate):
            result["search_points"] = e.points
        result["traceback"] = traceback.format_exc()[-4000:]
    result["build_s"] = round(time.perf_counter() - t0, 1)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: result.get(k) for k in ("peer", "status", "path", "build_s", "error")}))
    sys.exit(0 if result["status"] == "ok" else 1)


if __name__ == "__main__":
    main()
else:  # imported by Olive as the data configs' user_script
    _register_olive_components()
