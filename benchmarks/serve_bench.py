"""Serving figures for issue 4, measured side by side in one run.

The load generator shares the 2 cores with the server, so:
- the server runs in its own process, the load generator (one asyncio process, aiohttp keep-alive,
  the request body encoded once) in this one; the CPU each used is read (``bench.cputime``) and printed;
- every comparison is interleaved, the order flipped every round (A B B A ...), and reported as the median of
  per-round ratios with its order-statistics interval.

Parts:
1. efficiency: served throughput (binary tensors, concurrency 32) / offline batch-32 throughput of the
   same artifact measured with the servopt protocol in this process, per round;
2. servopt `classify` vs the tutorial's app (one JPEG per request, batch 1), concurrency 32;
3. open-loop Poisson at 50 %, 90 % and 200 % of the measured maximum rate; refused requests' latency;
4. batching at concurrency 1: p50 with batching on vs off.

    python benchmarks/serve_bench.py [--run runs/demo] [--model file.onnx] [--seconds 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from servopt.bench.protocol import Protocol, measure_batch
from servopt.data.dataset import Dataset
from servopt.machine import header
from servopt.optimize.rundir import load_run
from servopt.peers.runner import ratio_interval, round_order
from servopt.serve.harness import AppProcess, ServerProcess, free_port, servopt_env
from servopt.serve.loadtest import run_loadtest

ROOT = Path(__file__).resolve().parents[1]


SERVER_ARGS: list[str] = []


def servopt_server(model: Path, *extra: str) -> ServerProcess:
    return ServerProcess(model, "--name", "demo", *extra, *SERVER_ARGS)


def load(url: str, model: str, seconds: float, **kw) -> tuple[dict, float]:
    """One load step; returns (step, client CPU seconds used)."""
    t0 = os.times()
    report = asyncio.run(run_loadtest(url, model, duration=seconds, warmup=1.0, **kw))
    t1 = os.times()
    return report["steps"][0], (t1.user + t1.system) - (t0.user + t0.system)


def tutorial_load(url: str, jpeg: bytes, seconds: float, concurrency: int) -> dict:
    import base64

    from servopt.serve.loadtest import LoadGenerator, json_payload

    async def go() -> dict:
        import aiohttp

        gen = LoadGenerator(url, json_payload("/predict", {"image": base64.b64encode(jpeg).decode()}))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await gen.closed(session, concurrency, seconds, 10**9, 1.0)

    return asyncio.run(go())


def offline_throughput(model: Path, data: Dataset, seconds: float) -> float:
    from servopt.runtimes import open_session

    session = open_session({"format": "onnx", "path": str(model)}, "onnxruntime", {})
    return measure_batch(session, data, Protocol(batch_min_runs=10, batch_min_seconds=seconds), 32).throughput


def jpeg_bytes(data: Dataset) -> bytes:
    arr = data.inputs["input"][0].transpose(1, 2, 0)
    arr = ((arr - arr.min()) / (np.ptp(arr) + 1e-9) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).resize((320, 240)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, default=Path("runs/demo"))
    ap.add_argument("--model", type=Path, help="ONNX file (default: the run's cpu-server pick)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--parts", default="1,2,3,4", help="which parts to run, e.g. 1,3")
    ap.add_argument("--server-args", default="", help="extra `servopt serve` options for every servopt server")
    ap.add_argument("--torch-arch", default="mobilenet_v2", help="zoo architecture of the run's torch source (tutorial baseline)")
    args = ap.parse_args()
    SERVER_ARGS.extend(args.server_args.split())
    summary, run_records = load_run(args.run)
    records = {r.name: r for r in run_records}
    cpu = summary.decision("cpu-server")
    variant = cpu.recommended or cpu.nearest
    model = args.model or Path(records[variant].artifact.path)
    data = Dataset.load(args.run / "data" / "eval.npz")
    print(f"CPU: {header()} (shared machine)\nmodel: {model} ({variant})\n")
    out: dict = {"model": str(model), "variant": variant}

    parts = {int(p) for p in args.parts.split(",")}
    max_rate = None

    # 1. efficiency, interleaved offline / served
    if 1 in parts:
        max_rate = efficiency(model, data, args, out)
    if 2 in parts:
        versus_tutorial(model, data, args, out)
    if 3 in parts:
        open_loop(model, args, out, max_rate or 300.0)
    if 4 in parts:
        batching_cost(model, args, out)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))


def efficiency(model: Path, data: Dataset, args, out: dict) -> float:
    srv = servopt_server(model, "--max-batch", "32", "--max-delay-us", "2000", "--max-queue", "512")
    ratios, rows = [], []
    for r in range(args.rounds):
        def served_step() -> tuple[dict, float, float]:
            c0 = srv.cpu_seconds()
            step, client_cpu = load(srv.url, "demo", args.seconds, concurrency=[32])
            return step, client_cpu, srv.cpu_seconds() - c0

        # the order flipped every round: drift on the shared machine favours neither side
        steps = {"offline": lambda: offline_throughput(model, data, args.seconds / 2), "served": served_step}
        got = {k: steps[k]() for k in round_order(list(steps), r)}
        off, (step, client_cpu, server_cpu) = got["offline"], got["served"]
        served = step["throughput_rps"]
        ratios.append(served / off)
        rows.append({"offline_ips": off, "served_ips": served, "p99_ms": step["latency_ms"]["p99"],
                     "mean_batch": (step["server"] or {}).get("mean_batch_size"), "client_cpu_s": client_cpu, "server_cpu_s": server_cpu})
        print(f"[efficiency] round {r + 1}: offline batch-32 {off:.0f} img/s, served c=32 {served:.0f} img/s ({served / off:.0%}), "
              f"p99 {step['latency_ms']['p99']:.1f} ms, mean batch {rows[-1]['mean_batch']:.1f}, "
              f"CPU: server {server_cpu:.1f} s, load generator {client_cpu:.1f} s over {step['duration_s']:.1f} s")
    med, lo, hi, _ = ratio_interval(ratios)
    out["efficiency"] = {"rounds": rows, "median_ratio": med, "interval": [lo, hi]}
    print(f"[efficiency] served / offline: {med:.0%} [{lo:.0%}, {hi:.0%}] (need >= 75 %, aim 85 %)\n")
    srv.stop()
    return statistics.median(r["served_ips"] for r in rows)


def versus_tutorial(model: Path, data: Dataset, args, out: dict) -> None:
    """servopt classify vs the tutorial app, as written (PyTorch at batch 1) and with the same ONNX model."""
    jpeg = jpeg_bytes(data)
    img = args.run.resolve() / "work" / "bench.jpg"
    img.write_bytes(jpeg)
    config = json.loads((args.run / "config.json").read_text())
    baselines = {"tutorial app, PyTorch eager (as written)": [config["model"], "--arch", args.torch_arch],
                 "tutorial app, same ONNX model": [str(model)]}
    ours = servopt_server(model, "--max-batch", "32", "--max-delay-us", "2000", "--max-queue", "512")
    out["vs_tutorial"] = {}
    for label, app_args in baselines.items():
        port = free_port()
        tut = AppProcess([sys.executable, str(ROOT / "benchmarks" / "tutorial_app.py"), *app_args, "--port", str(port)], port,
                         env=servopt_env(), ready_path="/docs", start_timeout_s=60)
        rows = []
        for r in range(args.rounds):
            steps = {"servopt": lambda: load(ours.url, "demo", args.seconds, concurrency=[32], image=img)[0],
                     "tutorial": lambda: tutorial_load(tut.url, jpeg, args.seconds, 32)}  # noqa: B023 - called in this round
            got = {name: steps[name]() for name in round_order(list(steps), r)}
            a, b = got["servopt"], got["tutorial"]
            rows.append({"servopt_rps": a["throughput_rps"], "servopt_p99": a["latency_ms"]["p99"], "tutorial_rps": b["throughput_rps"],
                         "tutorial_p99": b["latency_ms"]["p99"], "servopt_errors": a["errors"], "tutorial_errors": b["errors"]})
            print(f"[vs {label}] round {r + 1}: servopt classify {a['throughput_rps']:.0f} req/s p99 {a['latency_ms']['p99']:.0f} ms | "
                  f"tutorial {b['throughput_rps']:.0f} req/s p99 {b['latency_ms']['p99']:.0f} ms")
        tut.stop()
        ratio, lo, hi, _ = ratio_interval([x["servopt_rps"] / x["tutorial_rps"] for x in rows])
        lower = sum(x["servopt_p99"] < x["tutorial_p99"] for x in rows)
        out["vs_tutorial"][label] = {"rounds": rows, "median_throughput_ratio": ratio, "interval": [lo, hi], "rounds_with_lower_p99": lower}
        print(f"[vs {label}] throughput {ratio:.2f}x [{lo:.2f}, {hi:.2f}] (need >= 1.5x), p99 lower in {lower}/{len(rows)} rounds\n")
    ours.stop()


def open_loop(model: Path, args, out: dict, max_rate: float) -> None:
    srv = servopt_server(model, "--max-batch", "32", "--max-delay-us", "2000", "--max-queue", "64")
    out["open_loop"] = []
    for share in (0.5, 0.9, 2.0):
        step, _ = load(srv.url, "demo", args.seconds, rate=[max_rate * share], distribution="poisson")
        out["open_loop"].append({"share": share, **step})
        refused = step.get("refused_latency_ms") or {}
        srv_lat = (step.get("server") or {}).get("server_latency") or {}
        print(f"[open loop] {share:.0%} of {max_rate:.0f}/s: {step['ok']} ok, {step['throughput_rps']:.0f} req/s, "
              f"client p50 {step['latency_ms']['p50']:.1f} ms, p99 {step['latency_ms']['p99']:.1f} ms, errors {step['errors'] or 'none'}"
              + (f", 503 seen by the client in p50 {refused['p50']:.1f} / p99 {refused['p99']:.1f} ms" if refused else ""))
        for code, p in srv_lat.items():
            print(f"    server-side {code}: {p['count']} requests, p50 <= {p['p50_ms_at_most']} ms, p99 <= {p['p99_ms_at_most']} ms")
    srv.stop()
    print(f"  (queue limit 64 samples ≈ {64 / max_rate * 1000:.0f} ms of work at the measured maximum rate)\n")


def batching_cost(model: Path, args, out: dict) -> None:
    on = servopt_server(model, "--max-batch", "32", "--max-delay-us", "2000")
    off = servopt_server(model, "--no-batching")
    pairs = []
    for r in range(args.rounds):
        servers = {"on": on, "off": off}
        got = {k: load(servers[k].url, "demo", args.seconds / 2, concurrency=[1])[0] for k in round_order(list(servers), r)}
        a, b = got["on"], got["off"]
        pairs.append((a["latency_ms"]["p50"], b["latency_ms"]["p50"]))
        print(f"[batching c=1] round {r + 1}: p50 with batching {a['latency_ms']['p50']:.2f} ms, without {b['latency_ms']['p50']:.2f} ms")
    on_p50, off_p50 = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    limit = (off_p50 + 2.0) * 1.10
    out["batching_c1"] = {"rounds": pairs, "on_p50": on_p50, "off_p50": off_p50, "limit_ms": limit}
    print(f"[batching c=1] {on_p50:.2f} ms vs {off_p50:.2f} ms: limit (off + 2 ms) + 10 % = {limit:.2f} ms -> "
          f"{'PASS' if on_p50 <= limit else 'FAIL'}")
    on.stop()
    off.stop()


if __name__ == "__main__":
    main()
