"""Served text embeddings cell by cell: ``servopt serve`` against a serving peer (Infinity) or against another setting or
revision of itself, the same client for every server (``benchmarks/text_servers.py`` runs the rounds; docs/benchmarks.md
its findings).

A cell is one load on one server: a closed loop at 1, 8 or 32 clients × 1 or 16 texts per request × short texts or
texts of exactly 128 tokens, a Poisson loop of one short text per request, and one shipped text per request at 32
clients (``served / offline``). Each request is OpenAI's ``POST /v1/embeddings`` with base64 answers, bodies encoded once
(``make_bodies``), loaded by ``serve.load``'s cheap raw sender; each cell's figures (``step_figures``) carry the server
process tree's CPU per request, the client's, and the share of the machine other processes took. ``model_alone_workload``
names the offline block (``bench.blocks``) that bounds a closed cell from above: what a server costing nothing but its
model calls would serve. ``summarize`` turns rounds into medians and per-round ratios, ``print_report`` prints them.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from servopt.bench.blocks import BlockWorker, answer_blocks, protocol_channel
from servopt.bench.cputime import machine_busy_s, own_cpu_s, tree_cpu_s, tree_kb
from servopt.bench.rounds import per_round_ratios, round_order
from servopt.families.metrics import cosine
from servopt.peers.builtin.infinity import MODEL as MODEL_NAME  # every server serves the model under this name
from servopt.serve.load import Closed, Open, Pool, Request, Schedule, StepSummary, open_sender, run

CONCURRENCY = (1, 8, 32)
TEXTS_PER_REQUEST = (1, 16)
LENGTHS = ("short", "128")
MAX_BATCH = 32  # servopt serve's default --max-batch (tests/test_benchmarks_text.py keeps the two equal)
SHORT_TOKENS = (8, 16)  # the shipped sentences with this many tokens (special tokens included) are the short texts


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


def step_figures(step: StepSummary, texts_per_request: int, ncpu: int = 1) -> dict:
    """One cell's figures from the load generator's step. Its ``probe``: the server's CPU seconds, then (when given) the
    machine's busy seconds and the client's own: what is left is other processes' load, as a share of the machine
    (``others_share``)."""
    probe = step.probe or [0.0]
    server_cpu_s, ok, wall = probe[0], step.ok, step.duration_s
    others = None
    if len(probe) == 3 and wall > 0:
        others = round(max(0.0, probe[1] - probe[0] - probe[2]) / (wall * ncpu), 3)
    nan = float("nan")
    return {"ok": ok, "errors": step.errors, "wall_s": round(wall, 3), "req_per_s": ok / wall if wall else 0.0,
            "texts_per_s": ok * texts_per_request / wall if wall else 0.0,
            "p50_ms": step.latency_ms.p50 if step.latency_ms.p50 is not None else nan,
            "p99_ms": step.latency_ms.p99 if step.latency_ms.p99 is not None else nan,
            "server_cpu_s": round(server_cpu_s, 3), "server_cpu_ms_per_request": server_cpu_s * 1000 / ok if ok else None,
            "client_cpu_ms_per_request": probe[2] * 1000 / ok if ok and len(probe) == 3 else None,
            "others_share": others, "unsent": step.client.unsent, "valid": step.valid}


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


async def load(url: str, requests: list[Request], schedule: Schedule, seconds: float, warmup: float,
               probe: Callable[[], tuple[float, ...]]) -> StepSummary:
    """One cell's load (``serve.load``, the cheap raw sender): the requests in turn, as the cell's bodies were made."""
    async with open_sender("raw", url) as sender:
        step, _ = await run(sender, Pool(requests), schedule, seconds, warmup=warmup, probe=probe)
    return step


def selected(all_cells: list[dict], patterns: str) -> list[dict]:
    globs = [g.strip() for g in patterns.split(",") if g.strip()]
    return [c for c in all_cells if any(fnmatch.fnmatchcase(c["name"], g) for g in globs)]


def measure_server(srv: Running, label: str, pools: dict, round_no: int, *, rate: float, patterns: str, seconds: float,
                   warmup: float) -> dict:
    """Every selected cell (``patterns``: globs) on one server, in order: each cell's figures, printed as they come."""
    out: dict = {}
    for cell in selected(cells(rate), patterns):
        bodies = make_bodies(pools[cell["length"]], cell["texts"], 256, seed=round_no * 1000 + len(out))
        def probe() -> tuple[float, float, float]:
            return srv.cpu_seconds(), machine_busy_s()[0], own_cpu_s()

        schedule = Closed(cell["concurrency"]) if cell["mode"] == "closed" else Open(cell["rate"], seed=round_no)
        step = asyncio.run(load(srv.url, [Request("/v1/embeddings", b) for b in bodies], schedule, seconds, warmup, probe))
        fig = step_figures(step, cell["texts"], os.cpu_count() or 1)
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


def served_rounds(names: list[str], start: Callable[[str], tuple[list[str], Running]], offline: BlockWorker, pools: dict,
                  reference: np.ndarray, rounds: int, commands: dict[str, dict], *, rate: float, patterns: str, seconds: float,
                  warmup: float) -> list[dict]:
    """Each round: servopt's INT8 file alone through servopt's text path (``offline``, an ``offline_worker``: the shipped
    texts, then each closed cell's model-alone workload), then each server started alone (``start(name)`` → its command
    and ``Running``, stopped after), in an order flipped every round: its start, memory, its embeddings' cosine to
    ``reference``, its cells (``measure_server``) and served / offline. ``commands`` gets each server's command."""
    alone = sorted({w for c in selected(cells(rate), patterns) if (w := model_alone_workload(c))})
    out: list[dict] = []
    for r in range(rounds):
        row: dict = {"servers": {}}
        ans = offline.ask({"op": "block", "backend": "offline", "workload": "texts", "min_calls": 1, "min_seconds": seconds,
                           "max_seconds": max(seconds * 4, 30.0)}, 900)
        row["offline_texts_per_s"] = block_texts_per_s(ans, "texts")
        print(f"round {r + 1}: offline (ONNX Runtime session, batches of 32) {row['offline_texts_per_s']:.1f} texts/s", flush=True)
        row["model_alone"] = {w: block_texts_per_s(offline.ask(
            {"op": "block", "backend": "offline", "workload": w, "min_calls": 3, "min_seconds": seconds / 2,
             "max_seconds": max(seconds * 2, 15.0)}, 900), w) for w in alone}
        if alone:
            print("  the model alone, texts/s: " + ", ".join(f"{w.removeprefix('pool:')} {v:.1f}" for w, v in row["model_alone"].items()),
                  flush=True)
        for name in round_order(names, r):
            cmd, srv = start(name)
            commands.setdefault(name, {"command": cmd})
            try:
                rss_mb = srv.rss_mb()
                print(f"  {name} ready in {srv.start_s:.1f} s ({rss_mb:.0f} MB)", flush=True)
                emb = embed(srv.url, pools["shipped"], "float")
                b64 = embed(srv.url, pools["shipped"][:16], "base64")
                cos = cosine(emb, reference)
                info = {"start_s": round(srv.start_s, 2), "rss_after_start_mb": round(rss_mb, 1),
                        "cosine": {"mean": float(cos.mean()), "min": float(cos.min()), "texts": len(cos),
                                   "base64_matches_float": float(np.abs(b64 - emb[:16]).max())}}
                info["cells"] = measure_server(srv, name, pools, r, rate=rate, patterns=patterns, seconds=seconds, warmup=warmup)
                info["peak_rss_mb"] = round(srv.peak_mb(), 1)
                if "c32-n1-shipped" in info["cells"]:
                    info["served_over_offline"] = info["cells"]["c32-n1-shipped"]["texts_per_s"] / row["offline_texts_per_s"]
                row["servers"][name] = info
            finally:
                srv.stop()
        out.append(row)
    return out


def offline_worker(argv: list[str]) -> None:
    """The offline side of served vs offline: servopt's INT8 file opened as servopt's runtime opens it (its default
    options: every core, the graph optimizations it makes on a CPU), servopt's tokenizer, length-sorted batches of 32
    (``families.text.text_encoder``); answers ``bench.blocks`` blocks."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="")
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--inputs", required=True)
    a = ap.parse_args(argv)
    out = protocol_channel()
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
    answer_blocks({"offline": encode}, inputs, {"side": "offline", "pid": os.getpid(), "onnx": a.onnx,
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


if __name__ == "__main__":  # the side processes of benchmarks/text_servers.py: python -m servopt.peers.cells --offline-worker …
    import sys

    {"--offline-worker": offline_worker, "--reference-worker": reference_worker}[sys.argv[1]](sys.argv[2:])
