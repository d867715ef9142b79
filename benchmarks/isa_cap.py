"""How far do figures move when a runtime is held to a poorer instruction set (a target's CPU stood in for)?

For each variant of a finished run (default: the demo's OpenVINO fp32 and NNCF INT8, torch eager, and ONNX Runtime
fp32 as the control that cannot be capped), measure it in fresh processes alternately without and with the cap
(``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` for the target ISA, what servopt sets for an ISA-capped target),
the order flipped every round (``peers.runner.run_rounds``), and print the median per-round ratio capped/uncapped of
p50 and batch throughput with its interval, and the kernels OpenVINO reports it ran (``brgconv_avx512_*`` vs
``brgconv_avx2_*``).

    python benchmarks/isa_cap.py [--run runs/demo] [--isa avx2] [--rounds 4] [--seconds 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from servopt.bench.jobs import MeasureJob
from servopt.bench.protocol import Protocol
from servopt.bench.rounds import ratio_interval
from servopt.machine import header
from servopt.optimize.rundir import load_run
from servopt.peers.runner import run_rounds
from servopt.runtimes import get_runtime

DEFAULT = ["ov-fp32-latency", "nncf-int8-latency", "torch-eager", "ort-fp32"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, default=Path("runs/demo"))
    ap.add_argument("--isa", default="avx2")
    ap.add_argument("--variants", nargs="*", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    _, records = load_run(args.run)
    by = {r.name: r for r in records if r.status == "ok"}
    proto = Protocol(min_runs=50, min_seconds=args.seconds, batch_size=32, batch_min_runs=8, batch_min_seconds=args.seconds,
                     cold_start=False)
    data = args.run / "data" / "eval.npz"
    print(f"CPU: {header()}; cap: {args.isa}; {args.rounds} rounds, order flipped each round (shared machine)")
    results = {}
    for name in args.variants:
        rec = by.get(name)
        if rec is None or rec.artifact is None:
            print(f"{name}: not in {args.run} (or did not run): skipped")
            continue
        cap = get_runtime(rec.runtime).isa_cap_env(args.isa) or {}
        rounds = run_rounds({"uncapped": MeasureJob.of_record(rec, data, "image-classification", proto),
                             "capped": MeasureJob.of_record(rec, data, "image-classification", proto, cap)},
                            args.rounds, args.run / "work" / "isa-cap" / name)
        if rounds.failed:
            print(f"{name}: failed: {rounds.failed}")
            continue

        def row(m):
            details = m.environment.session.details if m.environment and m.environment.session else {}
            return {"p50": m.latency_ms.p50, "tp": m.throughput_ips.batch, "kernels": details.get("kernels"),
                    "cpu_capability": details.get("cpu_capability")}

        rows = [{"uncapped": row(u), "capped": row(c)} for u, c in zip(rounds.measured["uncapped"], rounds.measured["capped"], strict=True)]
        p50 = ratio_interval([r["capped"]["p50"] / r["uncapped"]["p50"] for r in rows])
        tp = ratio_interval([r["capped"]["tp"] / r["uncapped"]["tp"] for r in rows])
        results[name] = {"runtime": rec.runtime, "cap_env": cap, "p50_ratio": p50, "throughput_ratio": tp, "rounds": rows}
        note = "cannot be capped (control)" if not cap else ", ".join(f"{k}={v}" for k, v in cap.items())
        kernels = rows[-1]["capped"]["kernels"] or rows[-1]["capped"]["cpu_capability"] or ""
        print(f"{name:24} p50 capped/uncapped {p50[0]:5.2f}x [{p50[1]:.2f}, {p50[2]:.2f}]  throughput {tp[0]:5.2f}x "
              f"[{tp[1]:.2f}, {tp[2]:.2f}]  [{note}] capped ran: {kernels}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"cpu": header(), "isa": args.isa, "variants": results}, indent=1))


if __name__ == "__main__":
    main()
