"""Overload: does admission by expected wait hold accepted latency to the budget, on REST and on gRPC? (issue 16)

Starts `servopt serve` on a model in its own process (REST and gRPC on free loopback ports), measures the
sustainable maximum rate (closed loop, one sample per request), then sends Poisson arrivals at a multiple of it
(default 2x) for --duration seconds on REST, then on gRPC. Per protocol it reports the accepted requests' latency
(p50/p99), how fast refusals came back (p50/p99, client side), counts by status, what the server refused at
admission and dropped after waiting (from /metrics), its mean model-call time, and its RSS at the start and end
of the phase. The CPU (model name and its AVX/VNNI/AMX flags) is printed with the figures: they mean nothing
without it. The load generator runs in this process, on the same cores as the server, as a client on the same
host would; the instrument (requests for both protocols, the open loop that sorts answers into accepted, refused and
dropped, the server's counters and RSS, the goal's checks) is ``servopt.serve.overload``, on the one load generator
(``servopt.serve.load``: latency from each request's scheduled time, the client's CPU and lag reported).

Goal (issue 16): at 2x overload for 10 minutes, accepted p99 <= budget + one model call, refusals in < 20 ms,
RSS growth < 10 %, on both protocols.

    python benchmarks/overload.py                          # MobileNetV2 with random weights, exported once
    python benchmarks/overload.py runs/demo --target cpu-server --duration 600 --json overload.json
    python benchmarks/overload.py model.onnx --multiple 1.5 --budget-ms 500 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import asdict
from pathlib import Path

from servopt.machine import header
from servopt.serve.harness import ServerProcess
from servopt.serve.overload import make_request, max_rate, overload

ROOT = Path(__file__).resolve().parents[1]


def default_model(work: Path) -> Path:
    """MobileNetV2 from servopt's zoo with random weights, exported to ONNX once (cached in ``work``)."""
    out = work / "mobilenet_v2-random.onnx"
    if out.exists():
        return out
    import torch

    from servopt.export import export_onnx
    from servopt.models.sources import load_model
    from servopt.models.zoo import build

    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    weights = work / "mobilenet_v2-random.pt"
    torch.save(build("mobilenet_v2", 1000).state_dict(), weights)
    export_onnx(load_model(weights, arch="mobilenet_v2"), out)
    return out


def report(s: dict) -> str:
    a, r, d, srv, rss = s["accepted_ms"], s["refused_ms"], s["dropped"], s["server"], s["rss_mb"]
    return (f"[{s['protocol']}] {s['rate_rps']:.0f}/s for {s['duration_s']:.0f} s: answers {s['statuses']}, not sent "
            f"{s['unsent']}; client {s['client']}; accepted "
            f"{s['accepted_rps']:.0f}/s p50 {a['p50']} / p99 {a['p99']} ms; refused p50 {r['p50']} / p99 {r['p99']} ms; "
            f"dropped {d['count']} (p50 {d['ms']['p50']} ms); "
            f"server refused {srv['refused']} dropped {srv['dropped']:.0f}, {srv['model_calls']} calls of {srv['mean_call_ms']} ms "
            f"(mean batch {srv['mean_batch']}); RSS {rss['start']} -> {rss['end']} MB ({rss['growth_pct']:+.1f} %, max {rss['max']}); "
            f"goal {s['goal']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", type=Path, help="an .onnx/.xml file, a run directory or a package "
                                                         "(default: MobileNetV2 with random weights, exported once)")
    ap.add_argument("--target", help="with a run directory: serve this target's pick (or its nearest)")
    ap.add_argument("--multiple", type=float, default=2.0, help="arrival rate as a multiple of the measured maximum")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of overload per protocol")
    ap.add_argument("--warmup", type=float, default=10.0,
                    help="uncounted seconds of overload before each phase (the allocator's arenas reach the batch shapes in use)")
    ap.add_argument("--max-rate-seconds", type=float, default=10.0, help="seconds of the closed-loop maximum-rate measurement")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight while measuring the maximum rate")
    ap.add_argument("--budget-ms", type=float, default=1000.0, help="the server's --latency-budget-ms")
    ap.add_argument("--protocols", default="rest,grpc")
    ap.add_argument("--server-args", default="", help="more `servopt serve` options, e.g. '--max-batch 16 --instances 2'")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "overload-bench", help="where the default model is exported")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()

    source = args.source or default_model(args.work)
    server_args = ["--name", "overload", "--latency-budget-ms", f"{args.budget_ms:g}", *args.server_args.split()]
    if args.target:
        # the target's pick, or its nearest when nothing meets it: the overload behaviour is the same either way
        server_args += ["--target", args.target, "--nearest"]
    machine: dict = {"model": header(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    print(f"CPU: {machine['model']}; load average {machine['load_average_at_start']} (other work on these cores shows in "
          "every figure)")
    with ServerProcess(source, *server_args, grpc=True) as server:
        import httpx

        meta = httpx.get(f"{server.url}/v2/models/overload", timeout=10).json()
        request = make_request(meta)
        rss_start = server.rss_bytes()
        top, seen = asyncio.run(max_rate(server.url, request, args.max_rate_seconds, args.concurrency))
        rate = top * args.multiple
        print(f"sustainable maximum: {top:.0f} requests/s (closed loop, concurrency {args.concurrency}, statuses {seen}); "
              f"overload: {args.multiple:g}x = {rate:.0f}/s, budget {args.budget_ms:g} ms, {args.duration:g} s per protocol")
        phases = []
        for protocol in args.protocols.split(","):
            phases.append(asyncio.run(overload(server, request, protocol, rate, args.duration, args.warmup, args.budget_ms)))
            print(report(phases[-1]))
        rss_end = server.rss_bytes()
    result = {"cpu": machine, "source": str(source), "server_args": server_args, "max_rate_rps": round(top, 1),
              "max_rate_statuses": seen,
              "multiple": args.multiple, "budget_ms": args.budget_ms, "phases": phases,
              "rss_mb_whole_run": {"start": round(rss_start / 1e6, 1), "end": round(rss_end / 1e6, 1)}}
    machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"RSS over the whole run: {rss_start / 1e6:.0f} -> {rss_end / 1e6:.0f} MB; load average {machine['load_average_at_end']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
