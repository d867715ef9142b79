"""How much the servopt harness adds to a bare ONNX Runtime loop (must be < 2 %).

A = ``servopt.bench.protocol.measure_latency`` (the code `servopt bench` runs),
B = a bare ``session.run`` loop with ``perf_counter_ns``, same session, same
inputs, same process. Rounds are interleaved A B A B so machine noise hits both
alike; the figure is the median over rounds of p50(A) / p50(B).

    python benchmarks/harness_overhead.py [--model model.onnx] [--rounds 6] [--seconds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from servopt.bench.protocol import Protocol, measure_latency
from servopt.bench.rounds import ratio_interval, round_order
from servopt.data.dataset import synthetic_inputs
from servopt.machine import header
from servopt.models.sources import load_model
from servopt.runtimes import open_session


def demo_onnx() -> Path:
    from servopt.demo import ensure_demo
    from servopt.export import export_onnx

    _, weights, _ = ensure_demo()
    out = weights.with_suffix(".onnx")
    if not out.exists():
        export_onnx(load_model(weights, arch="mobilenet_v2"), out)
    return out


def bare_loop(sess, feeds: list[dict], seconds: float, min_runs: int) -> float:
    out_names = [o.name for o in sess.get_outputs()][:1]
    for f in feeds[:10]:
        sess.run(out_names, f)
    times = []
    end = time.perf_counter_ns() + int(seconds * 1e9)
    i = 0
    while len(times) < min_runs or time.perf_counter_ns() < end:
        t0 = time.perf_counter_ns()
        sess.run(out_names, feeds[i % len(feeds)])
        times.append(time.perf_counter_ns() - t0)
        i += 1
    return float(np.median(times)) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    path = args.model or demo_onnx()
    model = load_model(path)
    data = synthetic_inputs(model.spec, count=32)
    session = open_session({"format": "onnx", "path": str(path)}, "onnxruntime", {})
    feeds = [data.slice(i, i + 1) for i in range(32)]
    proto = Protocol(min_runs=100, min_seconds=args.seconds)
    ratios = []
    with tempfile.TemporaryDirectory():
        for r in range(args.rounds):
            loops = {"servopt": lambda: measure_latency(session, data, proto).latency.p50,
                     "bare": lambda: bare_loop(session.sess, feeds, args.seconds, 100)}
            got = {k: loops[k]() for k in round_order(list(loops), r)}  # flipped every round: drift favours neither
            a, b = got["servopt"], got["bare"]
            ratios.append(a / b)
            print(f"round {r + 1}: servopt p50 {a:.3f} ms, bare p50 {b:.3f} ms, ratio {a / b:.4f}", flush=True)
    med, lo, hi, _ = ratio_interval(ratios)
    print(f"\nCPU: {header()} (shared machine)\nharness overhead (median of {args.rounds} interleaved rounds): "
          f"{(med - 1) * 100:+.2f} % [{(lo - 1) * 100:+.2f}, {(hi - 1) * 100:+.2f}] ({'PASS' if med < 1.02 else 'FAIL'}: must be < 2 %)")


if __name__ == "__main__":
    main()
