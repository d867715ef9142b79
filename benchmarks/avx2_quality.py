"""What a finished run's variants answer on an AVX2 CPU without VNNI, checked with that CPU's own kernels.

servopt decides for a target without VNNI from the host it runs on: each INT8 build carries the count of weight pairs
that ONNX Runtime's U8S8 kernel would saturate there (``passes.int8_overflow``), and ``decide`` flags one that has any.
This script checks that reading against the kernels themselves: run under ``benchmarks/avx2_cpu.sh`` (qemu presenting
an EPYC-Milan), it evaluates every ONNX Runtime and OpenVINO variant of the run on the run's evaluation split and
prints, beside the accuracy the run recorded on the host, the accuracy and the top-1 agreement with fp32 that the AVX2
kernels give (an embedding run: Spearman on the pairs, cosine to fp32), and servopt's flags: the overflow count, the
NCHWc block an offline graph was saved in. Speed is not measured (emulated).

    benchmarks/avx2_cpu.sh .venv/bin/python benchmarks/avx2_quality.py runs/demo [--limit 368] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from servopt.data.text import spearman
from servopt.machine import cpuid_features, header
from servopt.optimize.rundir import load_run


def emulated_cpu() -> dict[str, bool]:
    """The CPUID features that decide the kernels (``/proc/cpuinfo`` under qemu-user is the host's)."""
    cpuid = cpuid_features()
    return {k: cpuid.get(k, False) for k in ("AVX2", "FMA3", "AVX512F", "AVX512VNNI", "AVX512_SPR")}


def predict(runtime: str, path: str, feeds: dict[str, np.ndarray], lengths: np.ndarray | None, batch: int = 16) -> np.ndarray:
    """The first output for the whole split, one session, two threads; OpenVINO at fp32 inference precision (INT8 stays
    INT8). Texts go in batches of like length, cut to their longest (emulated, padding is what costs)."""
    order = np.argsort(lengths, kind="stable") if lengths is not None else np.arange(len(next(iter(feeds.values()))))
    if runtime == "openvino":
        import openvino as ov

        compiled = ov.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 2})
        names = [i.any_name for i in compiled.inputs]
        run = lambda b: compiled({n: b[n] for n in names})[compiled.output(0)]  # noqa: E731
    else:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        run = lambda b: session.run(None, {n: b[n] for n in names})[0]  # noqa: E731
    out = []
    for i in range(0, len(order), batch):
        rows = order[i:i + batch]
        cut = int(lengths[rows].max()) if lengths is not None else None
        out.append(run({k: v[rows][:, :cut] if cut else v[rows] for k, v in feeds.items()}))
    result = np.empty((len(order), *out[0].shape[1:]), out[0].dtype)
    result[order] = np.concatenate(out)
    return result


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--limit", type=int, default=0, help="first N evaluation samples (0: all; classifiers only)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cpu = emulated_cpu()
    if not cpu["AVX2"] or cpu["AVX512VNNI"] or cpu["AVX512F"]:
        raise SystemExit(f"this CPU reports {cpu}: run me on an AVX2 CPU without VNNI, or through "
                         "benchmarks/avx2_cpu.sh (qemu)")
    _, records = load_run(args.run)
    data = np.load(args.run / "data" / "eval.npz")
    feeds = {k.split(":", 1)[1]: data[k] for k in data.files if k.startswith("input:")}
    text = "labels" not in data.files
    labels = None if text else data["labels"]
    lengths = data["lengths"] if text else None
    if args.limit and not text:
        feeds, labels = {k: v[:args.limit] for k, v in feeds.items()}, labels[:args.limit]
    n = len(next(iter(feeds.values())))
    print(f"CPUID: {cpu} (servopt reads: {header()}); {n} evaluation samples of {args.run}")
    seen: dict[tuple[str, str], np.ndarray] = {}
    outputs: dict[str, np.ndarray] = {}
    rows = []
    for rec in records:
        art = rec.artifact
        if rec.status != "ok" or art is None or art.path is None or rec.runtime not in ("onnxruntime", "openvino"):
            continue
        key = (rec.runtime, art.path)
        t = time.perf_counter()
        if key not in seen:
            seen[key] = predict(rec.runtime, art.path, feeds, lengths)
        outputs[rec.name] = seen[key]
        q = rec.quality
        host = (q.pairs.spearman if text and q and q.pairs else
                q.accuracy.top1 if not text and q and q.accuracy else None)
        report = art.report or {}
        rows.append({"variant": rec.name, "runtime": rec.runtime, "file": art.path, "host": host,
                     "overflowing_pairs": report.get("u8s8_overflowing_pairs"),
                     "safe_without_vnni": report.get("safe_without_vnni"), "nchwc_block": report.get("nchwc_block"),
                     "seconds": round(time.perf_counter() - t, 1)})
        print(f"  {rec.name}: {rows[-1]['seconds']} s", flush=True)
    if "ort-fp32" not in outputs:
        raise SystemExit(f"{args.run} has no ort-fp32 result to compare with")
    ref = outputs["ort-fp32"]
    metric = "Spearman" if text else "top-1"
    print(f"\n{'variant':34} {'host ' + metric:>13} {'AVX2 ' + metric:>13} {'vs fp32':>8} "
          f"{'cos mean' if text else 'agree':>8}  servopt's flags")
    for r in rows:
        out = outputs[r["variant"]]
        if text:
            pa, pb = data["extra:pair_a"], data["extra:pair_b"]
            r["avx2"] = spearman(cosines(out[pa], out[pb]), data["extra:pair_score"])
            r["vs_fp32_points"] = round(100 * (r["avx2"] - spearman(cosines(ref[pa], ref[pb]), data["extra:pair_score"])), 2)
            cos = cosines(out, ref)
            r["agreement"], r["cosine_min"] = float(cos.mean()), float(cos.min())
        else:
            pred, fp32 = out.argmax(1), ref.argmax(1)
            r["avx2"] = float((pred == labels).mean())
            r["vs_fp32_points"] = round(100 * (r["avx2"] - float((fp32 == labels).mean())), 2)
            r["agreement"] = float((pred == fp32).mean())
        flags = []
        if r["safe_without_vnni"] is not None:
            flags.append(f"{r['overflowing_pairs']} overflowing pairs ({'safe' if r['safe_without_vnni'] else 'flagged'})")
        if r["nchwc_block"]:
            flags.append(f"NCHWc block {r['nchwc_block']}")
        host = f"{r['host']:.4f}" if r["host"] is not None else "-"
        print(f"{r['variant']:34} {host:>13} {r['avx2']:>13.4f} {r['vs_fp32_points']:>8.2f} {r['agreement']:>8.4f}  "
              f"{'; '.join(flags) or '-'}")
    if args.out:
        args.out.write_text(json.dumps({"cpuid": cpu, "servopt_reads": header(), "samples": n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
