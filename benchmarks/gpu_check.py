"""The GPU check (issue 34): servopt's GPU variants of the image and text demos, built and measured with servopt's own
passes, jobs and protocol, in one prepared run that needs no network. Each variant is verified against the original on
the GPU (torch-cuda fp32) and what ran is read back (the provider ``session.get_providers()`` names, the precision):
a variant that ran elsewhere or in another precision is recorded failed, never timed. Where no GPU, no CUDA provider or
no TensorRT exists, each variant it needs is reported skipped with the reason. Writes gpu-check.json and gpu-check.md.

    python benchmarks/gpu_check.py [--out gpu-check] [--demos image text] [--max-seconds 480] [--dry-run]

docs/hardware.md says how to run it on a lent GPU machine (no registry there: what it lacks travels as wheels).
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TRT, CUDA = "TensorrtExecutionProvider", "CUDAExecutionProvider"
# servopt's stopping rule, held short: 14 variants, each in a fresh process, within the device's 10 minutes a call.
PROTOCOL = {"warmup": 10, "min_runs": 100, "min_seconds": 2.0, "max_seconds": 15.0, "batch_size": 32, "batch_min_runs": 20,
            "batch_min_seconds": 2.0, "cold_start": False}


@dataclass(frozen=True)
class GpuVariant:
    """One GPU variant: its runtime and options, and the catalogue variant whose pass chain builds its artifact."""

    name: str
    runtime: str
    options: dict[str, Any] = field(default_factory=dict)
    chain_of: str | None = None  # None: the source model itself (torch)
    needs: str = "torch"  # torch | ort-cuda | ort-trt


VARIANTS = (  # the first is the reference every other is verified against
    GpuVariant("torch-cuda-fp32", "torch-cuda"),
    GpuVariant("torch-cuda-fp16", "torch-cuda", {"dtype": "fp16"}),
    GpuVariant("torch-cuda-fp16-cudagraphs", "torch-cuda", {"dtype": "fp16", "compile": "reduce-overhead"}),
    GpuVariant("ort-cuda-fp32", "onnxruntime-cuda", {"providers": [CUDA], "precision": "fp32"}, "ort-cuda-fp32", "ort-cuda"),
    GpuVariant("ort-cuda-fp16", "onnxruntime-cuda", {"providers": [CUDA], "precision": "fp16"}, "ort-fp16", "ort-cuda"),
    GpuVariant("ort-tensorrt-fp16", "onnxruntime-cuda", {"providers": [TRT, CUDA], "trt_fp16": True}, "ort-tensorrt-fp16", "ort-trt"),
    GpuVariant("ort-tensorrt-int8", "onnxruntime-cuda", {"providers": [TRT, CUDA], "trt_int8": True, "trt_fp16": True},
               "ort-int8-static-qdq", "ort-trt"),  # the QDQ graph calibrated on the demo's tuning split
)


@dataclass
class Facts:
    gpu: str | None
    torch_cuda: str  # "" where torch sees a CUDA device, else why not
    ort: str
    providers: list[str]
    tensorrt: bool  # TensorRT's library (libnvinfer, or the tensorrt wheels) is there
    dry_run: bool = False
    cpu: str = ""  # the host's CPU, beside every figure (a GPU's batch-1 latency depends on it too)


def probe(dry_run: bool = False) -> Facts:
    """What this machine offers (a dry run looks, then builds and measures nothing)."""
    from importlib.util import find_spec

    import onnxruntime

    from servopt.machine import cpu_model, gpu_name
    from servopt.runtimes import get_runtime

    gpu = gpu_name()
    torch_ok, why = get_runtime("torch-cuda").available() if gpu else (False, "no NVIDIA GPU")
    tensorrt = ctypes.util.find_library("nvinfer") is not None or any(find_spec(m) for m in ("tensorrt_libs", "tensorrt"))
    return Facts(gpu, "" if torch_ok else why, onnxruntime.__version__, onnxruntime.get_available_providers(), tensorrt, dry_run,
                 cpu_model())


def skip_reason(v: GpuVariant, facts: Facts) -> str | None:
    """Why ``v`` cannot run here (None: it can), the first missing piece named."""
    if facts.gpu is None:
        return "no NVIDIA GPU on this machine (nvidia-smi finds none)"
    if v.needs == "torch" and facts.torch_cuda:
        return facts.torch_cuda
    if v.needs.startswith("ort") and CUDA not in facts.providers:
        return f"this onnxruntime ({facts.ort}) has no {CUDA}: install onnxruntime-gpu"
    if v.needs == "ort-trt" and (TRT not in facts.providers or not facts.tensorrt):
        return f"no TensorRT: {TRT} {'is listed but libnvinfer is not installed' if TRT in facts.providers else 'is not listed'}"
    return "dry run: it would run here" if facts.dry_run else None


def load_demo(demo: str):
    """(model, data options) of ``servopt demo`` (image) or ``servopt demo --text``; cached once trained."""
    from servopt.demo import ensure_demo, ensure_text_demo
    from servopt.models.sources import load_model

    if demo == "text":
        folder, raw, _ = ensure_text_demo()
        return load_model(folder), raw
    data, weights, _ = ensure_demo()
    return load_model(weights, arch="mobilenet_v2"), {"data": data, "split": "evaluation"}


def run_demo(demo: str, facts: Facts, out: Path, deadline: float) -> list[dict]:
    """Each variant of ``demo`` built (the catalogue's chain, calibrated on the tuning split) and measured in its own
    process (``bench.run.measure``), or skipped with the reason; a failure costs its own row only."""
    reasons = {v.name: skip_reason(v, facts) for v in VARIANTS}
    skipped = lambda v, why: {"demo": demo, "variant": v.name, "status": "skipped", "error": why}  # noqa: E731
    if all(reasons.values()):  # nothing runs: no model is loaded
        return [skipped(v, reasons[v.name]) for v in VARIANTS]
    from servopt.bench.jobs import MeasureJob, OpenSpec
    from servopt.bench.protocol import Protocol
    from servopt.bench.run import measure
    from servopt.cli.common import data_options
    from servopt.errors import UserError
    from servopt.optimize.variants import catalogue
    from servopt.passes.base import BuildContext, build_chain, build_data_key, source_artifact

    try:
        model, raw = load_demo(demo)
    except UserError as e:  # the text demo's weights package missing: said per variant, the other demo still runs
        return [skipped(v, f"{e.problem} ({e.fix})") for v in VARIANTS]
    family, options = data_options(model, **raw)
    data, model.spec = family.read_eval(model.spec, options)
    tune, _ = family.read_tuning(model.spec, options)
    chains = {v.name: v.chain for v in catalogue(model, linear_heavy=demo == "text")}
    start, ctx = source_artifact(model, build_data_key(tune, tune)), BuildContext(source=model, calibration=tune, tuning=tune)
    (out / demo).mkdir(parents=True, exist_ok=True)
    data.save(out / demo / "eval.npz")
    rows, reference, saved = [], None, out / demo / "reference.npy"
    for v in VARIANTS:
        why = reasons[v.name] or ("out of time (--max-seconds)" if time.time() > deadline else None) or (
            f"the {demo} catalogue has no {v.chain_of}" if v.chain_of and v.chain_of not in chains else None) or (
            f"no reference: {VARIANTS[0].name} did not pass" if v is not VARIANTS[0] and reference is None else None)
        if why:
            rows.append(skipped(v, why))
            continue
        try:
            artifact = build_chain(start, chains[v.chain_of], out / demo / "artifacts", ctx) if v.chain_of else start
            job = MeasureJob(session=OpenSpec(name=v.name, artifact=artifact, runtime=v.runtime, options=v.options),
                             data=str(out / demo / "eval.npz"), family=family.name, reference=reference and str(reference),
                             save_outputs=None if reference else str(saved), protocol=Protocol(**PROTOCOL))
            record = measure(job, model.spec, out / demo / v.name)
        except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others' figures
            rows.append({"demo": demo, "variant": v.name, "status": "failed", "error": f"{type(e).__name__}: {e}"})
            continue
        reference = reference or (saved if record.status == "ok" else None)
        rows.append(row(demo, v.name, record))
    return rows


def row(demo: str, name: str, record) -> dict:
    """One record as the report's row: what ran (provider, precision) next to its figures."""
    ran = record.environment.session if record.environment else None
    return {"demo": demo, "variant": name, "status": record.status, "error": record.error,
            "provider": ran.provider_actual if ran else None, "precision": ran.precision_actual if ran else None,
            "p50_ms": record.latency_ms.p50 if record.latency_ms else None,
            "batch_per_s": record.throughput_ips.batch if record.throughput_ips else None, "batch": record.batch_size}


def _fig(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def write_report(out: Path, facts: Facts, rows: list[dict]) -> Path:
    """gpu-check.json (the machine's facts and every row) and gpu-check.md (a table the docs can take)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps({"facts": asdict(facts), "rows": rows}, indent=1))
    lines = [f"GPU: {facts.gpu or 'none'}; CPU: {facts.cpu}; onnxruntime {facts.ort} ({', '.join(facts.providers)}); "
             f"TensorRT library: {'yes' if facts.tensorrt else 'no'}", "",
             "| demo | variant | status | provider ran | precision ran | p50 batch-1 (ms) | batch/s (samples) | why not |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['demo']} | {r['variant']} | {r['status']} | {r.get('provider') or ''} | {r.get('precision') or ''} | "
              f"{_fig(r.get('p50_ms'), '.3f')} | {_fig(r.get('batch_per_s'), '.0f')} | {(r.get('error') or '').replace('|', '/')} |"
              for r in rows]
    (out / "gpu-check.md").write_text("\n".join(lines) + "\n")
    return out / "gpu-check.md"


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("gpu-check"))
    p.add_argument("--demos", nargs="+", choices=["image", "text"], default=["image", "text"])
    p.add_argument("--max-seconds", type=float, default=480.0, help="start no variant after this (the device gives 600 s a call)")
    p.add_argument("--dry-run", action="store_true", help="build and measure nothing: list every variant skipped, write the report")
    args = p.parse_args(argv)
    facts, deadline, rows = probe(args.dry_run), time.time() + args.max_seconds, []
    for demo in args.demos:  # the report written after each demo: a run cut short still leaves one
        rows += run_demo(demo, facts, args.out, deadline)
        report = write_report(args.out, facts, rows)
    print(report.read_text())
    return report


if __name__ == "__main__":
    main()
