"""Same-run comparison of variants that cannot share one process, and the first such comparison: ONNX Runtime's
OpenVINO execution provider (its own Python environment) against servopt's OpenVINO runtime and ONNX Runtime's CPU
provider, on the same artifacts.

Each variant is measured in a fresh process (a ``MeasureJob``, in its runtime's environment), the variants taking
turns: A B C, A B C, … for --rounds rounds; every ratio is the median of per-round ratios against the first variant.
Needs a run that measured them, e.g. `servopt demo --variants 'ortep-openvino-*' …` on top of the default sweep.

    python benchmarks/alternating.py [--run runs/demo] [--rounds 5] [--seconds 2] [--variants ort-fp32 ortep-openvino-fp32 …]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from servopt.bench.alternate import AlternationFailed, alternate
from servopt.bench.jobs import MeasureJob, OpenSpec
from servopt.bench.protocol import Protocol
from servopt.contracts import Record
from servopt.machine import cpu_features, cpu_model
from servopt.optimize.rundir import load_run

EP_COMPARISON = ["ort-fp32", "ortep-openvino-fp32", "ov-fp32-latency", "ort-int8-static-qdq", "ortep-openvino-int8-qdq", "ov-int8-qdq"]


def measure_job(run: Path, rec: Record, proto: Protocol, env: dict[str, str] | None = None) -> MeasureJob:
    assert rec.artifact is not None
    return MeasureJob(session=OpenSpec(name=rec.name, artifact=rec.artifact, runtime=rec.runtime, options=rec.options),
                      data=str(run / "data" / "eval.npz"), family="image-classification", protocol=proto, env={**rec.env, **(env or {})})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, default=Path("runs/demo"))
    ap.add_argument("--variants", nargs="*", default=EP_COMPARISON)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    _, records = load_run(args.run)
    by = {r.name: r for r in records if r.status == "ok"}
    missing = [v for v in args.variants if v not in by]
    if missing:
        raise SystemExit(f"not measured in {args.run}: {missing} (run the sweep with --variants for them first)")
    proto = Protocol(min_runs=50, min_seconds=args.seconds, batch_size=32, batch_min_runs=8, batch_min_seconds=args.seconds, cold_start=False)
    try:
        results = alternate({v: measure_job(args.run, by[v], proto) for v in args.variants}, args.rounds,
                            args.run / "work" / "alternating")
    except AlternationFailed as e:
        raise SystemExit(str(e)) from e
    base = args.variants[0]
    print(f"CPU: {cpu_model()} ({cpu_features().describe()}); {args.rounds} rounds, each variant in a fresh process, in turn")
    print(f"{'variant':28} {'runtime':22} {'provider that ran':34} {'p50 ms':>7} {'batch/s':>8} {'p50 vs ' + base:>18} {'tput vs ' + base:>18}")
    summary = {}
    for name, ms in results.items():
        p50 = statistics.median(m.latency_ms.p50 for m in ms)
        tp = statistics.median(m.throughput_ips.batch for m in ms)
        p50_r = statistics.median(m.latency_ms.p50 / b.latency_ms.p50 for m, b in zip(ms, results[base], strict=True))
        tp_r = statistics.median(m.throughput_ips.batch / b.throughput_ips.batch for m, b in zip(ms, results[base], strict=True))
        session = ms[-1].environment.session if ms[-1].environment else None
        provider = session.provider_actual if session else "?"
        versions = ms[-1].environment.libraries if ms[-1].environment else {}
        summary[name] = {"runtime": by[name].runtime, "provider": provider, "p50_ms": p50, "throughput_ips": tp, "p50_ratio": p50_r,
                         "throughput_ratio": tp_r, "libraries": versions, "runtime_env": ms[-1].environment.runtime_env if ms[-1].environment else None}
        print(f"{name:28} {by[name].runtime:22} {provider:34} {p50:7.2f} {tp:8.0f} {p50_r:17.2f}x {tp_r:17.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_model(), "flags": sorted(cpu_features().flags), "variants": summary}, indent=1))


if __name__ == "__main__":
    main()
