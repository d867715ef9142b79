"""Overload: does admission by expected wait hold accepted latency to the budget, on REST and on gRPC? (issue 16)

Starts `servopt serve` on a model in its own process (REST and gRPC on free loopback ports), measures the
sustainable maximum rate (closed loop, one sample per request), then sends Poisson arrivals at a multiple of it
(default 2x) for --duration seconds on REST, then on gRPC. Per protocol it reports the accepted requests' latency
(p50/p99), how fast refusals came back (p50/p99, client side), counts by status, what the server refused at
admission and dropped after waiting (from /metrics), its mean model-call time, and its RSS at the start and end
of the phase. The CPU (model name and its AVX/VNNI/AMX flags) is printed with the figures: they mean nothing
without it. The load generator runs in this process, on the same cores as the server, as a client on the same
host would.

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
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from servopt.machine import header
from servopt.serve.harness import ServerProcess
from servopt.serve.metrics import metrics_delta, read_metrics
from servopt.serve.protocol import DATATYPES, encode_raw_tensor

ROOT = Path(__file__).resolve().parents[1]
COUNTERS = ("servopt_refused_total", "servopt_dropped_total", "servopt_compute_seconds_sum", "servopt_compute_seconds_count",
            "servopt_batch_size_sum")
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


# --- requests ------------------------------------------------------------------------------------------------------

@dataclass
class Request:
    """One request's tensors, encoded once for both protocols."""

    rest_body: bytes
    rest_headers: dict[str, str]
    grpc: object  # pb.ModelInferRequest


def make_request(meta: dict) -> Request:
    from servopt.serve.proto import grpc_service_pb2 as pb

    rng = np.random.default_rng(0)
    arrays = {}
    for t in meta["inputs"]:
        shape = [1] + [d if d > 0 else 16 for d in t["shape"][1:]]
        if t["datatype"] == "BYTES":
            arr = np.empty(shape, dtype=object)
            arr[...] = b"A short sentence to embed, as a client would send it."
        else:
            dtype = DATATYPES[t["datatype"]]
            arr = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else np.ones(shape, dtype=dtype)
        arrays[t["name"]] = (t["datatype"], arr)
    raws = {n: encode_raw_tensor(a) for n, (_, a) in arrays.items()}
    header = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": dt, "parameters": {"binary_data_size": len(raws[n])}}
                         for n, (dt, a) in arrays.items()],
              "outputs": [{"name": o["name"], "parameters": {"binary_data": True}} for o in meta["outputs"]]}
    head = json.dumps(header).encode()
    grpc_request = pb.ModelInferRequest(
        model_name=meta["name"], inputs=[pb.ModelInferRequest.InferInputTensor(name=n, datatype=dt, shape=a.shape)
                                         for n, (dt, a) in arrays.items()],
        raw_input_contents=list(raws.values()))
    return Request(head + b"".join(raws.values()), {"Inference-Header-Content-Length": str(len(head)),
                                                     "Content-Type": "application/octet-stream"}, grpc_request)


# --- an open loop, the same for both protocols --------------------------------------------------------------------

Send = Callable[[], Awaitable[str]]  # one request → its status ("200", "503", "OK", "RESOURCE_EXHAUSTED", …)
DROPPED = "dropped"  # appended to a 503's status when the server dropped it after waiting (its message says so)


@dataclass
class Phase:
    protocol: str
    rate_rps: float
    duration_s: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    accepted_ms: list[float] = field(default_factory=list)
    refused_ms: list[float] = field(default_factory=list)  # refused at admission: the fast answer to overload
    dropped_ms: list[float] = field(default_factory=list)  # admitted, then dropped for waiting past the budget
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the phase, server RSS)
    skipped_by_client: int = 0  # arrivals not sent: the client's in-flight cap (the client must not become the queue)


async def open_loop(send: Send, ok: str, refused: set[str], phase: Phase, seconds: float, max_in_flight: int = 2048,
                    seed: int = 0, record: bool = True) -> None:
    """Poisson arrivals at ``phase.rate_rps`` for ``seconds``; each request's latency goes to accepted or refused."""
    rng = random.Random(seed)
    in_flight: set[asyncio.Task] = set()

    async def one() -> None:
        start = time.perf_counter()
        status = await send()
        ms = (time.perf_counter() - start) * 1000
        if not record:
            return
        phase.statuses[status] += 1
        if status == ok:
            phase.accepted_ms.append(ms)
        elif status.endswith(DROPPED):
            phase.dropped_ms.append(ms)
        elif status in refused:
            phase.refused_ms.append(ms)

    t = start = time.perf_counter()
    while t < start + seconds:
        t += rng.expovariate(phase.rate_rps)
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(in_flight) >= max_in_flight:
            phase.skipped_by_client += record
            continue
        task = asyncio.create_task(one())
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.wait(set(in_flight), timeout=60)
    if record:
        phase.duration_s = time.perf_counter() - start


def rest_sender(session, url: str, request: Request) -> Send:
    import aiohttp

    async def send() -> str:
        try:
            async with session.post(url, data=request.rest_body, headers=request.rest_headers) as r:
                body = await r.read()
                return f"{r.status} {DROPPED}" if r.status == 503 and b"dropped after waiting" in body else str(r.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            return type(e).__name__

    return send


def grpc_sender(stub, request: Request) -> Send:
    import grpc

    async def send() -> str:
        try:
            await stub.ModelInfer(request.grpc, timeout=60)
            return "OK"
        except grpc.aio.AioRpcError as e:
            dropped = "dropped after waiting" in (e.details() or "")
            return f"{e.code().name} {DROPPED}" if dropped else e.code().name

    return send


# --- the server's side -------------------------------------------------------------------------------------------

def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": round(float(np.percentile(values, 50)), 2), "p99": round(float(np.percentile(values, 99)), 2)}


def summarize(phase: Phase, counters: dict[str, float], budget_ms: float) -> dict:
    calls = counters.get("servopt_compute_seconds_count", 0.0)
    call_ms = counters.get("servopt_compute_seconds_sum", 0.0) / calls * 1000 if calls else None
    accepted, refused = percentiles(phase.accepted_ms), percentiles(phase.refused_ms)
    rss = [mb for _, mb in phase.rss_mb]
    growth = (rss[-1] - rss[0]) / rss[0] * 100
    goal = {"accepted_p99_within_budget_plus_one_call": accepted["p99"] is not None and call_ms is not None
            and accepted["p99"] <= budget_ms + call_ms,
            # the excess is what was refused at admission and what was dropped after waiting: both are answers to overload
            "excess_p99_under_20ms": (excess := percentiles(phase.refused_ms + phase.dropped_ms))["p99"] is None or excess["p99"] < 20,
            "rss_growth_under_10pct": growth < 10}
    return {"protocol": phase.protocol, "rate_rps": round(phase.rate_rps, 1), "duration_s": round(phase.duration_s, 1),
            "statuses": dict(phase.statuses), "skipped_by_client": phase.skipped_by_client,
            "accepted_rps": round(len(phase.accepted_ms) / phase.duration_s, 1) if phase.duration_s else 0.0,
            "accepted_ms": accepted, "refused_ms": refused,
            "dropped": {"count": len(phase.dropped_ms), "ms": percentiles(phase.dropped_ms)},
            "server": {"refused": {k.split('"')[1]: v for k, v in counters.items() if k.startswith("servopt_refused_total{")},
                       "dropped": counters.get("servopt_dropped_total", 0.0), "model_calls": int(calls),
                       "mean_call_ms": round(call_ms, 1) if call_ms else None,
                       "mean_batch": round(counters.get("servopt_batch_size_sum", 0.0) / calls, 1) if calls else None},
            "rss_mb": {"start": rss[0], "end": rss[-1], "max": max(rss), "growth_pct": round(growth, 1), "every_5s": phase.rss_mb},
            "goal": goal}


# --- the run ---------------------------------------------------------------------------------------------------

async def max_rate(url: str, request: Request, seconds: float, concurrency: int) -> tuple[float, dict[str, int]]:
    """Accepted requests/s with ``concurrency`` requests always in flight (closed loop, REST), and the statuses seen.
    A refused worker pauses 50 ms before its next request: a closed loop retrying refusals at once is a retry storm
    that measures the event loop, not the model."""
    import aiohttp

    statuses: Counter = Counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        send = rest_sender(session, url, request)

        async def worker(until: float, counts: Counter) -> None:
            while time.perf_counter() < until:
                status = await send()
                counts[status] += 1
                if status != "200":
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(worker(time.perf_counter() + 1.0, Counter()) for _ in range(concurrency)))  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker(start + seconds, statuses) for _ in range(concurrency)))
        return statuses["200"] / (time.perf_counter() - start), dict(statuses)


async def overload(server: ServerProcess, request: Request, protocol: str, rate: float, seconds: float, warmup: float,
                   budget_ms: float) -> dict:
    import aiohttp
    import grpc

    phase = Phase(protocol, rate)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session, \
            grpc.aio.insecure_channel(server.grpc_url) as channel:
        if protocol == "rest":
            send, ok, refused = rest_sender(session, f"{server.url}/v2/models/overload/infer", request), "200", {"503"}
        else:
            from servopt.serve.proto import grpc_service_pb2_grpc as pb_grpc

            send, ok = grpc_sender(pb_grpc.GRPCInferenceServiceStub(channel), request), "OK"
            refused = {"RESOURCE_EXHAUSTED", "UNAVAILABLE"}
        await open_loop(send, ok, refused, Phase(protocol, rate), warmup, record=False)  # connections, steady state
        before = read_metrics(server.url, COUNTERS)
        sampler = asyncio.create_task(sample_rss(server, phase))
        await open_loop(send, ok, refused, phase, seconds, seed=1)
        sampler.cancel()
        phase.rss_mb.append((round(phase.duration_s, 1), round(server.rss_bytes() / 1e6, 1)))
        after = read_metrics(server.url, COUNTERS)
    return summarize(phase, metrics_delta(before, after), budget_ms)


async def sample_rss(server: ServerProcess, phase: Phase, every_s: float = 5.0) -> None:
    """The server's RSS every few seconds of the phase: growth that levels off (allocator arenas reaching the shapes
    in use) reads differently from growth that does not (a leak)."""
    start = time.perf_counter()
    while True:
        phase.rss_mb.append((round(time.perf_counter() - start, 1), round(server.rss_bytes() / 1e6, 1)))
        await asyncio.sleep(every_s)


def report(s: dict) -> str:
    a, r, d, srv, rss = s["accepted_ms"], s["refused_ms"], s["dropped"], s["server"], s["rss_mb"]
    return (f"[{s['protocol']}] {s['rate_rps']:.0f}/s for {s['duration_s']:.0f} s: statuses {s['statuses']}; accepted "
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
        top, seen = asyncio.run(max_rate(f"{server.url}/v2/models/overload/infer", request, args.max_rate_seconds, args.concurrency))
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
