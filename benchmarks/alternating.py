"""Same-run comparison of variants that cannot share one process, and the first such comparison: ONNX Runtime's
OpenVINO execution provider (its own Python environment) against servopt's OpenVINO runtime and ONNX Runtime's CPU
provider, on the same artifacts.

Each variant is measured in a fresh process (a ``MeasureJob``, in its runtime's environment), the variants taking
turns, the order flipped every round (``peers.runner.run_rounds``): A B C, C B A, … for --rounds rounds; every ratio
is the median of per-round ratios against the first variant, with its order-statistics interval.
Needs a run that measured them, e.g. `servopt demo --variants 'ortep-openvino-*' …` on top of the default sweep.

    python benchmarks/alternating.py [--run runs/demo] [--rounds 5] [--seconds 2] [--variants ort-fp32 ortep-openvino-fp32 …]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from servopt.bench.jobs import MeasureJob
from servopt.bench.protocol import Protocol
from servopt.bench.rounds import ratio_interval
from servopt.machine import header
from servopt.optimize.rundir import load_run
from servopt.peers.runner import run_rounds

EP_COMPARISON = ["ort-fp32", "ortep-openvino-fp32", "ov-fp32-latency", "ort-int8-static-qdq", "ortep-openvino-int8-qdq", "ov-int8-qdq"]


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
    data = args.run / "data" / "eval.npz"
    rounds = run_rounds({v: MeasureJob.of_record(by[v], data, "image-classification", proto) for v in args.variants},
                        args.rounds, args.run / "work" / "alternating")
    base = args.variants[0]
    if base in rounds.failed:
        raise SystemExit(f"{base} failed: {rounds.failed[base]}")
    print(f"CPU: {header()}; {args.rounds} rounds, each variant in a fresh process, in turn, order flipped each round "
          f"(shared machine: {len(rounds.noisy_rounds())} noisy rounds)")
    print(f"{'variant':28} {'runtime':22} {'provider that ran':34} {'p50 ms':>7} {'batch/s':>8} {'p50 vs ' + base:>24} {'tput vs ' + base:>24}")
    summary = {}
    for name, ms in rounds.measured.items():
        if name in rounds.failed:
            print(f"{name:28} failed: {rounds.failed[name]}")
            continue
        pairs = [(m, b) for m, b in zip(ms, rounds.measured[base], strict=True) if m and b]
        p50_r = ratio_interval([m.latency_ms.p50 / b.latency_ms.p50 for m, b in pairs])
        tp_r = ratio_interval([m.throughput_ips.batch / b.throughput_ips.batch for m, b in pairs])
        env = pairs[-1][0].environment
        provider = env.session.provider_actual if env and env.session else "?"
        summary[name] = {"runtime": by[name].runtime, "provider": provider, "p50_ms": statistics.median(m.latency_ms.p50 for m, _ in pairs),
                         "throughput_ips": statistics.median(m.throughput_ips.batch for m, _ in pairs), "p50_ratio": p50_r,
                         "throughput_ratio": tp_r, "libraries": env.libraries if env else {},
                         "runtime_env": env.runtime_env if env else None, "noisy_rounds": rounds.flagged(name)}
        s = summary[name]
        print(f"{name:28} {by[name].runtime:22} {provider:34} {s['p50_ms']:7.2f} {s['throughput_ips']:8.0f} "
              f"{p50_r[0]:7.2f}x [{p50_r[1]:.2f}, {p50_r[2]:.2f}] {tp_r[0]:7.2f}x [{tp_r[1]:.2f}, {tp_r[2]:.2f}]")
    if args.out:
        args.out.write_text(json.dumps({"cpu": header(), "order": rounds.order, "variants": summary}, indent=1))


if __name__ == "__main__":
    main()
