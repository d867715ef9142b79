"""Does the variant servopt picks for cpu-server beat ONNX Runtime defaults by the required margin?

Requirement (issue 15): on a demo MobileNetV2, measured side by side in one run against ONNX Runtime with default
settings (fp32, ORT_ENABLE_ALL), the cpu-server pick (or nearest) is within 1 point of fp32 accuracy and keeps >= 90 %
of the plain (accuracy-failing) INT8's same-run speedup: on an AVX2-only CPU >= 1.3x batch-32 throughput and <= 0.6x
p50 batch-1 latency; on a CPU with 8-bit dot products (VNNI) >= 2.0x and <= 0.55x.

It re-measures the pick, the plain U8S8 INT8 (built even where it fails verification: its artifact is in the run) and
the reference (plus any extra --variants) in one process, interleaved (A B A B, --rounds rounds of --seconds per
phase), and prints the median of the per-round ratios. Needs a finished demo run (`servopt demo [--seed N]`).

    python benchmarks/optimize_speedup.py [--run runs/demo] [--rounds 6] [--seconds 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from servopt.bench.jobs import InterleaveJob, OpenSpec
from servopt.bench.launcher import launch
from servopt.bench.protocol import Protocol
from servopt.cpu import CpuFeatures
from servopt.machine import cpu_features
from servopt.optimize.rundir import load_run

REFERENCE_ORT = "ort-fp32"  # the baseline variant of every catalogue


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, default=Path("runs/demo"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--variants", nargs="*", default=[])
    args = ap.parse_args()
    summary, records = load_run(args.run)
    cpu = summary.decision("cpu-server")
    chosen = cpu.pick
    by = {r.name: r for r in records}
    plain = "ort-int8-static-qop-u8s8"
    extra = [plain] if plain in by and by[plain].artifact is not None else []
    names = [n for n in dict.fromkeys([chosen, *extra, *args.variants]) if n != REFERENCE_ORT] + [REFERENCE_ORT]
    proto = Protocol(min_runs=100, min_seconds=args.seconds, batch_size=32, batch_min_runs=10, batch_min_seconds=args.seconds)
    env = {k: v for n in names for k, v in by[n].env.items()}
    job = InterleaveJob(sessions=[OpenSpec.of(by[n]) for n in names],
                        reference=REFERENCE_ORT, data=str(args.run / "data" / "eval.npz"), protocol=proto, rounds=args.rounds, env=env)
    launched = launch(job, args.run / "work" / "speedup")
    if launched.result is None:
        raise SystemExit(launched.error)
    result = launched.result
    ref_acc = by[REFERENCE_ORT].quality.accuracy.top1
    cpu_flags = CpuFeatures(frozenset(result.environment.cpu_flags)) if result.environment else cpu_features()
    vnni = cpu_flags.int8_dot
    need_tp, need_p50 = (2.0, 0.55) if vnni else (1.3, 0.6)
    print(f"CPU: {result.environment.cpu if result.environment else '?'} ({cpu_flags.describe()}; flags {' '.join(sorted(cpu_flags.flags))})")
    print(f"{'variant':32} {'p50 ms':>8} {'batch/s':>8} {'p50 ratio':>10} {'tput ratio':>10} {'top-1':>8}  per-round p50 ms")
    for n, v in result.variants.items():
        acc = by[n].quality.accuracy.top1
        print(f"{n:32} {v.p50_ms:8.2f} {v.throughput_ips:8.0f} {v.p50_ratio_vs_reference:9.2f}x {v.throughput_ratio_vs_reference:9.2f}x "
              f"{acc:8.2%}  {', '.join(f'{x:.2f}' for x in v.p50_ms_rounds)}")
    c = result.variants[chosen]
    drop = (ref_acc - by[chosen].quality.accuracy.top1) * 100
    ok = c.throughput_ratio_vs_reference >= need_tp and c.p50_ratio_vs_reference <= need_p50 and drop <= 1.0
    print(f"\ncpu-server pick {chosen}: throughput {c.throughput_ratio_vs_reference:.2f}x (need >= {need_tp}x), "
          f"p50 {c.p50_ratio_vs_reference:.2f}x (need <= {need_p50}x), accuracy drop {drop:+.2f} points vs fp32 (need <= 1) "
          f"-> {'PASS' if ok else 'FAIL'}")
    if plain in result.variants and plain != chosen:
        p = result.variants[plain]
        plain_drop = (ref_acc - by[plain].quality.accuracy.top1) * 100
        kept = (c.throughput_ratio_vs_reference - 1) / (p.throughput_ratio_vs_reference - 1) if p.throughput_ratio_vs_reference > 1 else None
        kept_p50 = (1 - c.p50_ratio_vs_reference) / (1 - p.p50_ratio_vs_reference) if p.p50_ratio_vs_reference < 1 else None
        print(f"plain INT8 ({plain}, drop {plain_drop:+.2f} points): throughput {p.throughput_ratio_vs_reference:.2f}x, p50 "
              f"{p.p50_ratio_vs_reference:.2f}x; the pick keeps "
              f"{'n/a' if kept is None else f'{kept:.0%}'} of its throughput gain and "
              f"{'n/a' if kept_p50 is None else f'{kept_p50:.0%}'} of its p50 reduction (need >= 90 %)")


if __name__ == "__main__":
    main()
