"""Speed servopt must reach on a sentence encoder (issue 8): its picks against sentence-transformers' own backends.

On all-MiniLM-L6-v2, measured in one run, interleaved, and printed as same-run ratios with the CPU named:

1. sentence-transformers (ST), in an environment of its own (``servopt.envs.ensure_env``, name ``st-peers``; never
   servopt's venv), each backend built with ST's own functions by ``benchmarks/text_peers.py``: ``backend="torch"``
   (``encode`` runs under ``torch.inference_mode()``), ``backend="onnx"`` (its default export) and its dynamic INT8
   (``export_dynamic_quantized_onnx_model``, ``avx512_vnni`` preset on a VNNI CPU, else ``avx2``),
   ``backend="openvino"`` (its default: OpenVINO decides the precision, bf16 on a bf16 CPU; the JSON records what the
   compiled model reports) and its static INT8 (``export_static_quantized_openvino_model``, calibrated on the shipped
   texts given as a local dataset, since its default GLUE download cannot be reached). Each is timed through its own
   ``model.encode(texts, batch_size=B)`` (ST sorts a call's texts by character length, longest first, and batches
   them in that order; ``text_peers.describe`` records it).
2. servopt's picks from a text run directory (``servopt demo --text`` / ``servopt optimize``): the cpu-server pick
   (recommended, else the nearest miss, as ``servopt serve --target cpu-server --nearest`` serves it) and the best
   latency variant (lowest same-run p50 in the run's interleaved re-measure; ``--latency-variant`` overrides), each
   opened as servopt opens it (``OpenSpec.open``), texts in and embeddings out: servopt's tokenizer (the server's
   code), length-sorted batches of 32 (``servopt.data.text.length_sorted_batches``), each padded to its longest.
3. The same three workloads for everyone: 32 texts of exactly 128 tokens at batch 32 (both tokenizers are checked to
   give 128), one short sentence at batch 1 (p50 of calls), and the 308 shipped texts with their real lengths at
   batch 32 (texts/s; one call encodes them all).

How it is interleaved. ST and servopt cannot share a process (different environments), so the interleaving is at the
process level: one long-lived worker per side (``text_peers.py worker`` in the ST env, this file's
``--servopt-worker`` in servopt's venv), both loaded and warmed up before any timing, each answering "time backend X
on workload W for at least S seconds" over a pipe while the other waits blocked on its pipe. A round runs every
workload as ST blocks then servopt blocks (the order flips every round); a ratio is taken between blocks of the same
round and workload, and the figure reported is the median of the per-round ratios. Both sides time with the same
loop (``servopt.bench.blocks.time_block``), encode the same texts, and report their own CPU and the machine's other load per
block (the idle peer's CPU is read too). The alternative, a fresh pair of processes per round, was rejected: every
round would pay model loading, export caches and warm-up (seconds to tens of seconds for OpenVINO and Optimum)
between the A and B blocks, so the two sides of a ratio would be minutes apart on a machine whose load changes by the
minute, and the figure would mix cold-start effects into a steady-state comparison.

Quality guard: every backend's embeddings of the shipped texts against ST's torch backend (the original): mean and
minimum cosine. A backend under a mean cosine of 0.99 (servopt's own verification threshold) cannot be "ST's best".

4. Serving (``--parts serve``): ``servopt serve RUN --target cpu-server --nearest`` (its defaults: two single-thread
   instances for a throughput target, length-aware batching), raw text over ``POST /v2/models/{name}/infer`` (a
   ``BYTES`` input ``text``, one text per request, tokenized in the server), closed loop at concurrency 32 over the
   shipped texts in a shuffled order (a small aiohttp client in this process), alternating round by round with the
   offline throughput of the same variant on the same texts (the servopt worker's ``texts`` workload) → served /
   offline. Length-aware vs first-come batching: servopt's server has no setting for first-come batching (length
   grouping applies whenever the model has a sequence axis, ``serve/batcher.py``), so a second server is started by
   this file (``--first-come-server``) with the one change, made in that benchmark process only, that the text
   family reports no sequence length: its batcher then takes requests in arrival order (no overtaking, no token
   budget), exactly what it does for image models. Both get the same load; padding waste and tokens come from each
   server's ``/metrics`` (``servopt_tokens_total{kind="real"|"padding"}``). At concurrency 32 with ``max_batch`` 32 a
   batch takes the whole queue, so grouping has little to choose from; ``--batching-concurrency`` adds levels where the
   queue is longer than a batch (default 32,128). ``SERVOPT_*`` variables set for this script reach both servers
   (e.g. ``SERVOPT_MAX_BATCH_TOKENS=1024``) and are recorded in the JSON.

    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/text_speed.py --run runs/demo-text \\
        --out runs/demo-text/text_speed.json [--rounds 7] [--seconds 3] [--serve-seconds 10] [--parts speed,serve]

    # smoke (figures mean nothing): a small run, then short blocks
    SERVOPT_OPTIMIZE_QUICK=1 PYTHONPATH=src .venv/bin/python -m servopt demo --text --out /tmp/tb-demo \\
        --variants torch-eager --variants ort-fp32 --variants ort-int8-accuracy-aware --variants ov-bf16-latency \\
        --targets cpu-server
    PYTHONPATH=src .venv/bin/python benchmarks/text_speed.py --run /tmp/tb-demo --rounds 2 --seconds 0.5 \\
        --serve-seconds 3 --out /tmp/tb-speed.json

The first run creates the ST environment (about 5 min, 1.9 GB under ``$SERVOPT_HOME/envs``) and builds the ST
backends into ``<run>/work/text-speed/st-model`` (about 1.5 min; reused afterwards, ``--rebuild`` redoes them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from servopt.bench.blocks import WORKLOADS, BlockWorker, answer_blocks, protocol_channel, warm_and_check
from servopt.data.text import exact_length_texts
from servopt.serve import rawhttp
from servopt.serve.harness import AppProcess

HERE = Path(__file__).resolve().parent
ST_BACKENDS = ("st-torch", "st-onnx", "st-onnx-int8", "st-openvino", "st-openvino-int8")  # text_peers.py builds them

ENV_NAME = "st-peers"
PEERS = HERE / "text_peers.py"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true"}
MIN_COSINE = 0.99  # servopt's verification threshold (SERVOPT_OPTIMIZE_VERIFY_MIN_COSINE): a backend under it is not "best"
AIM = {"b32x128_pick_over_best_st": 1.2, "texts_pick_over_best_st": 1.5, "b1_latency_pick_over_fastest_st": 0.8,
       "b1_torch_over_latency_pick": 6.0}
SHORT_TOKENS = 12  # the batch-1 sentence: the shipped text nearest this many tokens
MODEL_NAME = "minilm"


def st_requirements() -> list[str]:
    """The ST environment. sentence-transformers 6.x cannot have its ``[onnx]`` extra: that extra needs optimum-onnx,
    whose only releases (≤ 0.1.0) cap transformers below 4.58, while ST 6 needs transformers ≥ 5. 5.7.0 is the newest
    ST whose ``[onnx]`` and ``[openvino]`` extras install together (optimum 2.1.0 + optimum-onnx 0.1.0 + optimum-intel
    1.27.0, transformers 4.57). ONNX Runtime and OpenVINO are pinned to this venv's versions, so both sides run the same
    runtimes; torch==2.13.0 takes the local CPU wheel; ``datasets`` for the static INT8 calibration."""
    return [f"onnxruntime=={metadata.version('onnxruntime')}", f"openvino=={metadata.version('openvino')}",
            "sentence-transformers[onnx,openvino]==5.7.0", "optimum-onnx[onnxruntime]==0.1.0", "optimum-intel[openvino]==1.27.0",
            "torch==2.13.0", "transformers>=4.57,<4.58", "datasets"]


# ---------------------------------------------------------------------------------------------------- inputs


def make_inputs(spec, calibration: str) -> tuple[dict, dict]:
    from servopt.data.text import DEMO_SENTENCES, batching_waste, padding_waste, read_texts
    from servopt.families.text import TUNING_EVERY, tokenizer_of

    tok = tokenizer_of(spec)
    texts = read_texts(DEMO_SENTENCES)
    lengths = [len(e.ids) for e in tok.encode(texts)]
    short = min(range(len(texts)), key=lambda i: (abs(lengths[i] - SHORT_TOKENS), i))
    words = " ".join(texts).split()
    calib = texts if calibration == "all" else [t for i, t in enumerate(texts) if i % TUNING_EVERY == TUNING_EVERY - 1]
    inputs = {"b32x128": exact_length_texts(tok, words, 32, 128), "short": texts[short], "texts": texts}
    arr = np.asarray(lengths)
    by_chars = np.argsort([-len(t) for t in texts], kind="stable")  # ST's encode order: characters, longest first
    waste = batching_waste(arr, 32)
    waste["st_character_sorted"] = padding_waste([by_chars[i:i + 32] for i in range(0, len(texts), 32)], arr)
    info = {"texts_source": str(DEMO_SENTENCES), "texts": len(texts), "short": texts[short], "short_tokens": lengths[short],
            "token_lengths": {"p50": float(np.percentile(arr, 50)), "p95": float(np.percentile(arr, 95)), "max": int(arr.max()),
                              "mean": float(arr.mean()), "sum": int(arr.sum())},
            "calibration": calibration, "calibration_texts": len(calib), "max_length": tok.max_length,
            "padding_waste_b32": {"first_come": waste["first_come"], "servopt_token_sorted": waste["sorted"],
                                  "st_character_sorted": waste["st_character_sorted"]}}
    return {**inputs, "calibration": calib}, info


# ------------------------------------------------------------------------------------------ worker processes


def st_env() -> tuple[object | None, dict]:
    from servopt.envs import EnvCreationError, EnvSpec, ensure_env
    from servopt.errors import UserError

    spec = EnvSpec(name=ENV_NAME, requirements=st_requirements())
    t0 = time.perf_counter()
    made: list[str] = []

    def progress(line: str) -> None:
        made.append(line)
        if line.startswith(("creating", "environment", "ERROR", "Successfully installed")):
            print(f"  [env] {line[:160]}", flush=True)

    try:
        ready = ensure_env(spec, progress)
    except (EnvCreationError, UserError) as e:
        return None, {"status": "failed", "requirements": spec.requirements, "error": e.problem, "fix": e.fix}
    wanted = {"sentence-transformers", "optimum", "optimum-onnx", "optimum-intel", "onnxruntime", "openvino", "nncf", "torch",
              "transformers", "tokenizers", "datasets", "numpy", "onnx"}
    return ready, {"status": "ready", "folder": str(ready.folder), "requirements": spec.requirements, "created_now": bool(made),
                   "created_s": ready.created_s, "size_mb": ready.size_mb, "python": ready.python_version,
                   "wall_s": round(time.perf_counter() - t0, 1),
                   "versions": {k: v for k, v in ready.packages.items() if k.lower() in wanted}}


def st_process_env(ready, work: Path) -> dict:
    from servopt.envs import job_env

    env = {**job_env(ready), **OFFLINE_ENV, "HF_HOME": str(work / "hf-home")}
    env["PYTHONPATH"] = str(HERE.parent / "src")  # servopt's stdlib-only instruments (bench.blocks); nothing heavy
    return env


def build_st(ready, model_dir: Path, work: Path, backends: list[str], rebuild: bool, timeout: float) -> dict:
    calib = work / "calibration.txt"
    cmd = [str(ready.python), str(PEERS), "build", "--model", str(model_dir), "--work", str(work), "--calibration", str(calib),
           "--backends", ",".join(backends), *(["--rebuild"] if rebuild else [])]
    t0 = time.perf_counter()
    with open(work / "st-build.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=st_process_env(ready, work), cwd=work, timeout=timeout)
    built = json.loads((work / "build.json").read_text()) if (work / "build.json").exists() else {}
    if proc.returncode != 0 and not built:
        built = {b: {"status": "failed", "error": f"the builder exited {proc.returncode} (log {work / 'st-build.log'})"} for b in backends}
    return {"wall_s": round(time.perf_counter() - t0, 1), "backends": built, "log": str(work / "st-build.log")}


# ------------------------------------------------------------------------------------------- servopt's side


def servopt_worker(args) -> None:
    out = protocol_channel()
    from servopt.bench.jobs import OpenSpec
    from servopt.families.text import text_encoder, tokenizer_of
    from servopt.optimize.rundir import load_config, load_run

    run = Path(args.run)
    spec = load_config(run).spec
    _, records = load_run(run)
    by = {r.name: r for r in records}
    inputs = json.loads(Path(args.inputs).read_text(encoding="utf-8"))
    backends, failed, infos, toks = {}, {}, {}, {}
    for name in [v for v in args.variants.split(",") if v]:
        try:
            r = by[name]
            t0 = time.perf_counter()
            session = OpenSpec(name=name, artifact=r.artifact.opened(), runtime=r.runtime, options=r.options).open()
            encode, tok = text_encoder(spec, session), tokenizer_of(spec)
            backends[name], toks[name] = encode, tok
            infos[name] = {"runtime": r.runtime, "options": r.options, "artifact": r.artifact.path, "description": r.description,
                           "load_s": round(time.perf_counter() - t0, 2), "session": session.info().model_dump(mode="json"),
                           "run_cosine_mean": r.quality.agreement.cosine_mean if r.quality and r.quality.agreement else None}
        except Exception as e:  # noqa: BLE001
            failed[name] = f"{type(e).__name__}: {str(e)[:600]}"

    def lengths_of(tok, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in tok.encode(texts)]

    tokens = warm_and_check(backends, inputs, failed, lengths_of, toks)
    answer_blocks(backends, inputs, {"side": "servopt", "pid": os.getpid(), "backends": infos, "failed": failed,
                                        "tokens": tokens}, out)


def first_come_server(argv: list[str]) -> None:
    """``servopt serve`` with first-come batching: the text family reports no sequence length, so the batcher takes
    requests in arrival order with no length grouping (as for image models). A benchmark-only change, this process
    only."""
    from servopt.families.text import TextEmbedding

    TextEmbedding.sequence_length = lambda self, feed: None  # type: ignore[method-assign]
    from servopt.cli import app

    app(args=argv, prog_name="servopt")


def picks(run: Path, latency_variant: str | None) -> tuple[dict, list]:
    from servopt.optimize.rundir import load_run

    summary, records = load_run(run)
    if summary is None:
        raise SystemExit(f"{run} has no summary.json: let `servopt optimize` / `servopt demo --text` finish first")
    by = {r.name: r for r in records}
    decision = summary.decision("cpu-server")
    cpu_pick = (decision.recommended or decision.nearest) if decision else None
    if not cpu_pick or cpu_pick not in by:
        raise SystemExit(f"{run} has no cpu-server pick (recommended or nearest)")

    def usable(r) -> bool:
        return (r.status == "ok" and r.artifact is not None and r.name != "torch-plain"
                and (r.quality is None or r.quality.agreement is None or r.quality.agreement.cosine_mean is None
                     or r.quality.agreement.cosine_mean >= MIN_COSINE))

    if latency_variant:
        lat, source = latency_variant, "--latency-variant"
    else:
        inter = summary.interleaved.variants if summary.interleaved else {}
        cands = {n: v.p50_ms for n, v in inter.items() if n in by and usable(by[n])}
        source = "lowest p50 in the run's interleaved re-measure"
        if not cands:
            cands = {r.name: r.latency_ms.p50 for r in records if usable(r) and r.latency_ms}
            source = "lowest p50 in the run's sweep (no interleaved re-measure)"
        lat = min(cands, key=cands.get)
    target = decision.target
    return ({"cpu_server": cpu_pick, "cpu_server_target": {"hardware": target.hardware, "isa": target.isa, "objective": target.objective},
             "cpu_server_how": "recommended" if decision.recommended else
             f"nearest (no variant passes cpu-server: {decision.shortfall})", "latency": lat, "latency_how": source,
             "cosine_in_run": {n: (by[n].quality.agreement.cosine_mean if by[n].quality and by[n].quality.agreement else None)
                               for n in {cpu_pick, lat}}},
            records)


# ------------------------------------------------------------------------------------------------- timing


def block_figures(ans: dict, workload: str, ncpu: int) -> dict:
    times = np.asarray(ans["times_ns"], dtype=np.float64) / 1e6
    items = ans["items_per_call"]
    other = max(0.0, ans["machine_busy_s"] - ans["own_cpu_s"])
    return {"calls": len(times), "p50_ms": float(np.percentile(times, 50)), "p90_ms": float(np.percentile(times, 90)),
            "mean_ms": float(times.mean()), "items_per_s": items * len(times) / (times.sum() / 1000),
            "wall_s": round(ans["wall_s"], 3), "own_cpu_s": round(ans["own_cpu_s"], 3),
            "other_share": round(other / (ans["wall_s"] * ncpu), 4) if ans["wall_s"] > 0 else None,
            "stopped_by": ans.get("stopped_by")}


def metric(workload: str) -> str:
    return "p50_ms" if workload == "b1short" else "items_per_s"


def median_ratio(a: list[float], b: list[float]) -> float | None:
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x and y]
    return statistics.median(x / y for x, y in pairs) if pairs else None


def run_speed(st: BlockWorker, so: BlockWorker, st_names: list[str], so_names: list[str], args, ncpu: int) -> dict:
    """Rounds of [ST blocks, servopt blocks] per workload (order flipped every round): per-block figures by backend."""
    blocks: dict[str, dict[str, list[dict]]] = {n: {w: [] for w in WORKLOADS} for n in [*st_names, *so_names]}
    min_calls = {"b32x128": args.min_calls_batch, "b1short": args.min_calls_single, "texts": 1}
    for r in range(args.rounds):
        for w in WORKLOADS:
            sides = [(st, st_names, so), (so, so_names, st)]
            if r % 2:
                sides.reverse()
            for worker, names, other in sides:
                for name in names:
                    c0 = other.cpu_s()
                    ans = worker.ask({"op": "block", "backend": name, "workload": w, "min_calls": min_calls[w],
                                      "min_seconds": args.seconds, "max_seconds": max(args.seconds * 4, 30.0)},
                                     timeout=max(args.seconds * 4, 30.0) + 600)
                    if not ans.get("ok"):
                        print(f"  round {r + 1} {w} {name}: FAILED {ans.get('error')}", flush=True)
                        blocks[name][w].append({"error": ans.get("error")})
                        continue
                    fig = block_figures(ans, w, ncpu)
                    fig["idle_peer_cpu_s"] = round(other.cpu_s() - c0, 3)
                    blocks[name][w].append(fig)
                    unit = "ms p50" if w == "b1short" else "texts/s"
                    print(f"  round {r + 1} {w:8} {name:28} {fig[metric(w)]:9.2f} {unit}  ({fig['calls']} calls, "
                          f"others {fig['other_share']:.0%} of the machine, idle peer {fig['idle_peer_cpu_s']:.2f} s CPU)", flush=True)
    return blocks


def summarize_speed(blocks: dict, st_names: list[str], so_names: list[str], quality: dict, pick: str, lat_pick: str) -> dict:
    def series(name: str, w: str) -> list[float | None]:
        return [b.get(metric(w)) for b in blocks[name][w]]

    figures = {n: {w: {"median": statistics.median([x for x in series(n, w) if x is not None]) if any(x is not None for x in series(n, w)) else None,
                       "rounds": series(n, w), "metric": metric(w),
                       "flagged_rounds": sum(1 for b in blocks[n][w] if (b.get("other_share") or 0) > 0.10)}
                   for w in WORKLOADS} for n in blocks}
    ratios = {}
    for v in so_names:
        for b in st_names:
            for w in WORKLOADS:
                ratios.setdefault(v, {}).setdefault(b, {})[w] = median_ratio(series(v, w), series(b, w))
    eligible = [b for b in st_names if (quality.get(b) or {}).get("cosine_mean", 0) >= MIN_COSINE]
    excluded = {b: (quality.get(b) or {}).get("cosine_mean") for b in st_names if b not in eligible}

    def best(w: str, fastest: bool) -> str | None:
        have = [b for b in eligible if figures[b][w]["median"] is not None]
        if not have:
            return None
        return (min if fastest else max)(have, key=lambda b: figures[b][w]["median"])

    best32, best_texts, fastest1 = best("b32x128", False), best("texts", False), best("b1short", True)
    out = {"eligible_st": eligible, "excluded_st_for_quality": excluded, "best_st": {"b32x128": best32, "texts": best_texts, "b1short": fastest1}}

    def check(key: str, value: float | None, higher_is_better: bool, what: str) -> dict:
        aim = AIM[key]
        met = None if value is None else bool(value >= aim if higher_is_better else value <= aim)
        return {"value": value, "aim": aim, "met": met, "what": what}

    torch_over_lat = None
    if "st-torch" in blocks and lat_pick in blocks:
        torch_over_lat = median_ratio(series("st-torch", "b1short"), series(lat_pick, "b1short"))
    out["verdicts"] = {
        "b32x128_pick_over_best_st": check("b32x128_pick_over_best_st", ratios.get(pick, {}).get(best32, {}).get("b32x128") if best32 else None,
                                           True, f"{pick} / {best32}, batch-32 × 128-token throughput (aim >= 1.2x)"),
        "texts_pick_over_best_st": check("texts_pick_over_best_st", ratios.get(pick, {}).get(best_texts, {}).get("texts") if best_texts else None,
                                         True, f"{pick} / {best_texts}, shipped texts at real lengths, batch 32, texts/s (aim >= 1.5x)"),
        "b1_latency_pick_over_fastest_st": check("b1_latency_pick_over_fastest_st",
                                                 ratios.get(lat_pick, {}).get(fastest1, {}).get("b1short") if fastest1 else None,
                                                 False, f"{lat_pick} p50 / {fastest1} p50, batch 1, short sentence (aim <= 0.8x)"),
        "b1_torch_over_latency_pick": check("b1_torch_over_latency_pick", torch_over_lat, True,
                                            f"st-torch p50 / {lat_pick} p50, batch 1 (PyTorch eager vs servopt's latency pick; aim 6x)"),
    }
    return {"figures": figures, "ratios_servopt_over_st": ratios, **out}


def cosines(emb_dir: Path, names: list[str], reference: str) -> dict:
    ref = np.load(emb_dir / f"{reference}.npy").astype(np.float64)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    out = {}
    for n in names:
        p = emb_dir / f"{n}.npy"
        if not p.exists():
            continue
        e = np.load(p).astype(np.float64)
        e /= np.linalg.norm(e, axis=1, keepdims=True)
        c = (e * ref).sum(axis=1)
        out[n] = {"cosine_mean": float(c.mean()), "cosine_min": float(c.min()), "cosine_p1": float(np.percentile(c, 1)),
                  "texts": len(c), "against": reference}
    return out


# ------------------------------------------------------------------------------------------------ serving




def infer_body(texts: list[str]) -> bytes:
    return json.dumps({"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}).encode()


def closed_loop(url: str, bodies: list[bytes], order: list[int], concurrency: int, duration: float, warmup: float) -> dict:
    """Closed loop (``serve.rawhttp``): ``concurrency`` clients, each sending one text per request (the next of
    ``order``, cycling) and the next as soon as the answer is in. Server figures from /metrics before and after."""
    from servopt.bench.cputime import own_cpu_s
    from servopt.serve.loadtest import server_split
    from servopt.serve.metrics import read_metrics

    snaps: list[dict[str, float]] = []

    def probe() -> tuple[float]:
        snaps.append(read_metrics(url))
        return (own_cpu_s(),)

    raw = asyncio.run(rawhttp.closed_loop(f"{url}/v2/models/{MODEL_NAME}/infer", [bodies[i] for i in order], concurrency,
                                          duration, warmup, probe))
    before, after = snaps
    lat, errors, wall = raw["latencies_ms"], raw["errors"], raw["wall_s"]

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    real, pad = d('servopt_tokens_total{kind="real"}'), d('servopt_tokens_total{kind="padding"}')
    arr = np.asarray(lat) if lat else np.asarray([np.nan])
    split = server_split(before, after) or {}
    return {"concurrency": concurrency, "duration_s": round(wall, 3), "ok": len(lat), "errors": errors,
            "texts_per_s": len(lat) / wall if wall else 0.0,
            "latency_ms": {"p50": float(np.nanpercentile(arr, 50)), "p99": float(np.nanpercentile(arr, 99))},
            "real_tokens": real, "padding_tokens": pad, "padding_waste": pad / real if real else None,
            "real_tokens_per_s": real / wall if wall else None,
            "mean_batch_size": split.get("mean_batch_size"), "batches": split.get("batches"),
            "mean_compute_ms_per_batch": split.get("mean_compute_ms_per_batch"), "mean_queue_ms": split.get("mean_queue_ms"),
            "client_cpu_s": round(raw["cpu_deltas"][0], 3)}


def check_served(server: AppProcess, texts: list[str], offline: np.ndarray) -> dict:
    import httpx

    r = httpx.post(f"{server.url}/v2/models/{MODEL_NAME}/infer", content=infer_body(texts),
                   headers={"Content-Type": "application/json"}, timeout=60)
    r.raise_for_status()
    out = r.json()["outputs"][0]
    served = np.asarray(out["data"], dtype=np.float64).reshape(out["shape"])
    ref = offline.astype(np.float64)
    cos = (served * ref).sum(1) / (np.linalg.norm(served, axis=1) * np.linalg.norm(ref, axis=1))
    return {"texts": len(texts), "max_abs_diff": float(np.abs(served - ref).max()), "cosine_min": float(cos.min())}


def run_serve(so: BlockWorker, pick: str, run: Path, inputs: dict, env: dict, work: Path, args, ncpu: int) -> dict:
    """Served (closed loop, raw text) vs offline throughput of the same variant, and length-aware vs first-come
    batching, alternating round by round."""
    import httpx

    from servopt.serve.harness import free_port

    texts = inputs["texts"]
    bodies = [infer_body([t]) for t in texts]
    order = list(range(len(texts)))
    random.Random(0).shuffle(order)  # traffic does not arrive sorted
    base = ["serve", str(run), "--target", "cpu-server", "--nearest", "--name", MODEL_NAME, *args.server_args.split()]
    servers: dict[str, AppProcess] = {}
    out: dict = {"order": "shuffled (seed 0), cycling", "server_args": base,
                 "server_env": {k: v for k, v in env.items() if k.startswith("SERVOPT_")}}  # e.g. SERVOPT_MAX_BATCH_TOKENS
    try:
        port = free_port()
        servers["length-aware"] = AppProcess([sys.executable, "-m", "servopt", *base, "--port", str(port)], port, env=env,
                                             start_timeout_s=180)
        port = free_port()
        servers["first-come"] = AppProcess([sys.executable, str(Path(__file__).resolve()), "--first-come-server", *base,
                                            "--port", str(port)], port, env=env, start_timeout_s=180)
        out["served_variant"] = httpx.get(f"{servers['length-aware'].url}/v2/models/{MODEL_NAME}", timeout=10).json().get("parameters", {})
        so.ask({"op": "embed", "backend": pick, "out": str(work / "emb" / "serve-check.npy"), "key": "texts"}, 600)
        offline_emb = np.load(work / "emb" / "serve-check.npy")[:8]
        out["served_matches_offline"] = {k: check_served(s, texts[:8], offline_emb) for k, s in servers.items()}
        levels = [int(c) for c in args.batching_concurrency.split(",") if c.strip()]
        if args.concurrency not in levels:
            levels.insert(0, args.concurrency)
        rounds = []
        for r in range(args.rounds):
            row: dict = {}
            steps = [("offline", None, None)] + [(f"{k}@c{c}", k, c) for c in levels for k in servers]
            if r % 2:
                steps = [steps[0], *reversed(steps[1:])]
            for label, key, conc in steps:
                if key is None:
                    ans = so.ask({"op": "block", "backend": pick, "workload": "texts", "min_calls": 1,
                                  "min_seconds": args.serve_seconds, "max_seconds": max(args.serve_seconds * 4, 30.0)}, 900)
                    if not ans.get("ok"):
                        raise RuntimeError(f"offline block failed: {ans.get('error')}")
                    row[label] = block_figures(ans, "texts", ncpu)
                    print(f"  round {r + 1} offline {pick}: {row[label]['items_per_s']:.1f} texts/s", flush=True)
                    continue
                srv = servers[key]
                others = [s for s in servers.values() if s is not srv]
                c0, o0, w0 = srv.cpu_seconds(), sum(s.cpu_seconds() for s in others), so.cpu_s()
                step = closed_loop(srv.url, bodies, order, conc, args.serve_seconds, args.serve_warmup)
                step["server_cpu_s"] = round(srv.cpu_seconds() - c0, 3)
                step["idle_cpu_s"] = round(sum(s.cpu_seconds() for s in others) - o0 + so.cpu_s() - w0, 3)
                row[label] = step
                waste = f"{step['padding_waste']:.1%}" if step["padding_waste"] is not None else "?"
                print(f"  round {r + 1} {label:20} {step['texts_per_s']:7.1f} texts/s  p50 {step['latency_ms']['p50']:.0f} ms "
                      f"p99 {step['latency_ms']['p99']:.0f} ms  padding waste {waste}  mean batch "
                      f"{step['mean_batch_size'] or 0:.1f}  errors {step['errors'] or 'none'}  CPU server {step['server_cpu_s']:.1f} s, "
                      f"client {step['client_cpu_s']:.1f} s", flush=True)
            rounds.append(row)
        out["rounds"] = rounds
        c = args.concurrency
        ratio = [row[f"length-aware@c{c}"]["texts_per_s"] / row["offline"]["items_per_s"] for row in rounds]
        out["served_over_offline"] = {"per_round": ratio, "median": statistics.median(ratio), "aim": 0.8,
                                      "met": bool(statistics.median(ratio) >= 0.8), "concurrency": c}
        out["batching"] = {}
        for lvl in levels:
            la = [row[f"length-aware@c{lvl}"] for row in rounds]
            fc = [row[f"first-come@c{lvl}"] for row in rounds]
            out["batching"][str(lvl)] = {
                "throughput_length_aware_over_first_come": statistics.median(a["texts_per_s"] / b["texts_per_s"] for a, b in zip(la, fc, strict=True) if b["texts_per_s"]),
                "padding_waste_length_aware": statistics.median(a["padding_waste"] for a in la if a["padding_waste"] is not None),
                "padding_waste_first_come": statistics.median(b["padding_waste"] for b in fc if b["padding_waste"] is not None),
                "texts_per_s_length_aware": statistics.median(a["texts_per_s"] for a in la),
                "texts_per_s_first_come": statistics.median(b["texts_per_s"] for b in fc),
                "mean_batch_length_aware": statistics.median(a["mean_batch_size"] or 0 for a in la),
                "mean_batch_first_come": statistics.median(b["mean_batch_size"] or 0 for b in fc)}
    finally:
        for s in servers.values():
            s.stop()
    return out


# ------------------------------------------------------------------------------------------------- report


def json_default(o):
    """numpy scalars as Python numbers (``default=str`` would write ``False`` as the truthy string "False")."""
    return o.item() if isinstance(o, np.generic) else str(o)


def print_report(rep: dict) -> None:
    smoke = " — SMOKE RUN: short blocks on a shared machine, figures mean nothing" if rep["smoke"] else ""
    print(f"\nCPU: {rep['cpu']['model']} — {rep['cpu']['summary']}, {rep['cpu']['cores']} cores{smoke}")
    env = rep.get("st_env") or {}
    if env.get("status") == "ready":
        print("ST env: " + ", ".join(f"{k} {v}" for k, v in sorted(env["versions"].items())))
    print(f"servopt picks: cpu-server {rep['picks']['cpu_server']} ({rep['picks']['cpu_server_how']}); "
          f"latency {rep['picks']['latency']} ({rep['picks']['latency_how']})")
    t = rep["picks"]["cpu_server_target"]
    if t.get("isa") and t["isa"] != rep["cpu"]["summary"].split(",")[0]:
        print(f"  note: the cpu-server target is {t['hardware']} ({t['isa']}); this CPU has {rep['cpu']['summary']}: servopt chose "
              f"for the target's instruction set, the ST backends use whatever this CPU has")
    inp = rep["inputs"]
    w = inp["padding_waste_b32"]
    print(f"texts: {inp['texts']} shipped texts, tokens p50 {inp['token_lengths']['p50']:.0f} / p95 {inp['token_lengths']['p95']:.0f} / "
          f"max {inp['token_lengths']['max']}; padding waste at batch 32: first-come {w['first_come']:.0%}, sorted by tokens "
          f"(servopt) {w['servopt_token_sorted']:.0%}, sorted by characters (ST's encode) {w['st_character_sorted']:.0%}; "
          f"batch-1 sentence {inp['short_tokens']} tokens: {inp['short']!r}")
    if "token_check" in rep:
        print(f"128-token texts are 128 tokens under every backend's own tokenizer: {rep['token_check']['b32x128_all_128_tokens']}")
    for name, why in {**rep.get("failed", {})}.items():
        print(f"  {name}: NOT MEASURED — {why}")
    sp = rep.get("speed")
    if sp:
        q = rep["quality"]
        print(f"\n{rep['rounds']} interleaved rounds, blocks of >= {rep['args']['seconds']} s; medians over rounds "
              f"(texts/s; batch 1: p50 ms); cosine: mean (min) against st-torch on {rep['inputs']['texts']} texts")
        print(f"{'backend':30} {'b32x128 /s':>11} {'b1 p50 ms':>10} {'texts /s':>9}  {'cosine':>16}  {'noisy':>5}  details")
        for n, f in sp["figures"].items():
            qq = q.get(n) or {}
            cos = f"{qq['cosine_mean']:.4f} ({qq['cosine_min']:.3f})" if qq else "?"
            det = rep["details"].get(n, "")

            def fmt(w: str, fig=f) -> str:
                v = fig[w]["median"]
                return "—" if v is None else f"{v:.2f}" if w == "b1short" else f"{v:.1f}"

            noisy = sum(f[w]["flagged_rounds"] for w in f)
            print(f"{n:30} {fmt('b32x128'):>11} {fmt('b1short'):>10} {fmt('texts'):>9}  {cos:>16}  {noisy:>5}  {det}")
        print("(noisy: blocks during which other processes used over 10 % of the machine)")
        print(f"ST backends under mean cosine {MIN_COSINE} (never 'best'): {sp['excluded_st_for_quality'] or 'none'}")
        print("\nsame-run ratios (median of per-round ratios), servopt / ST:")
        for v, per in sp["ratios_servopt_over_st"].items():
            for b, r in per.items():
                print(f"  {v:26} / {b:18} b32x128 {r['b32x128'] or float('nan'):5.2f}x   b1 p50 {r['b1short'] or float('nan'):5.2f}x   "
                      f"texts {r['texts'] or float('nan'):5.2f}x")
        print("\nthe issue's figures:")
        for k, v in sp["verdicts"].items():
            val = "n/a" if v["value"] is None else f"{v['value']:.2f}x"
            state = "n/a" if v["met"] is None else ("MET" if v["met"] else "NOT MET")
            print(f"  {k:34} {val:>7}  {state:8} {v['what']}")
    sv = rep.get("serve")
    if sv and "served_over_offline" in sv:
        s = sv["served_over_offline"]
        print(f"\nserving {rep['picks']['cpu_server']} (servopt serve --target cpu-server --nearest {' '.join(sv['server_args'][7:])}"
              f"{' ' + str(sv['server_env']) if sv['server_env'] else ''}), raw text, one text per request, closed loop c={s['concurrency']}:")
        print(f"  served / offline texts/s per round: {', '.join(f'{x:.0%}' for x in s['per_round'])} -> median {s['median']:.0%} "
              f"(aim >= 80 %: {'MET' if s['met'] else 'NOT MET'})")
        for k, c in sv["served_matches_offline"].items():
            print(f"  {k} server vs offline embeddings of the same 8 texts (one request): max |diff| {c['max_abs_diff']:.2g}, min cosine {c['cosine_min']:.5f}")
        for lvl, b in sv["batching"].items():
            print(f"  c={lvl}: length-aware {b['texts_per_s_length_aware']:.1f} texts/s, padding waste {b['padding_waste_length_aware']:.1%}, "
                  f"mean batch {b['mean_batch_length_aware']:.1f} | first-come {b['texts_per_s_first_come']:.1f} texts/s, padding waste "
                  f"{b['padding_waste_first_come']:.1%}, mean batch {b['mean_batch_first_come']:.1f} | throughput ratio "
                  f"{b['throughput_length_aware_over_first_come']:.2f}x")
    elif sv:
        print(f"\nserving: FAILED — {sv.get('error')}")


def detail_line(name: str, info: dict) -> str:
    if name.startswith("st-openvino"):
        return f"OpenVINO {info.get('INFERENCE_PRECISION_HINT', '?')}, hint {info.get('PERFORMANCE_HINT', '?')}, streams {info.get('NUM_STREAMS', '?')}"
    if name.startswith("st-onnx"):
        return f"ORT {info.get('graph_optimization_level', '?')}, {','.join(info.get('providers', []))}"
    if name == "st-torch":
        return f"torch {info.get('torch')}, {info.get('torch_threads')} threads, attn {info.get('attn_implementation')}"
    sess = info.get("session") or {}
    return f"servopt {info.get('runtime')} {info.get('options') or ''} precision {sess.get('precision_actual', '?')}"


# --------------------------------------------------------------------------------------------------- main


def main() -> None:
    if sys.argv[1:2] == ["--first-come-server"]:
        first_come_server(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, default=Path("runs/demo-text"), help="a finished text run directory")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default <run>/text_speed.json)")
    ap.add_argument("--parts", default="speed,serve")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=3.0, help="minimum seconds per timed block")
    ap.add_argument("--min-calls-single", type=int, default=100, help="minimum batch-1 calls per block")
    ap.add_argument("--min-calls-batch", type=int, default=5, help="minimum batch-32 calls per block")
    ap.add_argument("--st-backends", default=",".join(ST_BACKENDS))
    ap.add_argument("--variants", default="", help="more servopt variants of the run to time (comma-separated)")
    ap.add_argument("--latency-variant", default=None, help="servopt's latency pick (default: lowest interleaved p50 in the run)")
    ap.add_argument("--st-calibration", choices=["all", "tuning"], default="all",
                    help="texts ST's static INT8 calibrates on: all shipped texts (ST then uses its default 128-sample "
                         "subset) or servopt's tuning split (every 4th)")
    ap.add_argument("--serve-seconds", type=float, default=10.0, help="seconds per served / offline block")
    ap.add_argument("--serve-warmup", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--batching-concurrency", default="32,128", help="levels for length-aware vs first-come")
    ap.add_argument("--server-args", default="", help="extra `servopt serve` options for both servers")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--servopt-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inputs", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.servopt_worker:
        servopt_worker(args)
        return

    from servopt.machine import cpu_features, cpu_model
    from servopt.optimize.rundir import load_config

    os.environ.update({k: v for k, v in OFFLINE_ENV.items() if k != "TOKENIZERS_PARALLELISM"})
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    run = args.run.resolve()
    out_path = args.out or run / "text_speed.json"
    work = run / "work" / "text-speed"
    (work / "emb").mkdir(parents=True, exist_ok=True)
    smoke = args.rounds < 5 or args.seconds < 2 or args.serve_seconds < 5
    started = time.time()
    ncpu = os.cpu_count() or 1
    feats = cpu_features()
    report: dict = {"what": "servopt's picks vs sentence-transformers' backends, all-MiniLM-L6-v2 (issue 8)", "smoke": smoke,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "run": str(run), "rounds": args.rounds,
                    "cpu": {"model": cpu_model(), "summary": feats.describe(), "flags": sorted(feats.flags), "cores": ncpu},
                    "aims": AIM, "args": {k: str(v) for k, v in vars(args).items()}, "failed": {}, "details": {}}

    config = load_config(run)
    if config is None:
        raise SystemExit(f"{run} has no config.json")
    model_dir = Path(config.model)
    pk, records = picks(run, args.latency_variant)
    report["picks"] = pk
    by = {r.name: r for r in records}
    so_names = list(dict.fromkeys([pk["cpu_server"], pk["latency"], *[v for v in args.variants.split(",") if v]]))
    print(f"model: {model_dir}\nservopt: cpu-server pick {pk['cpu_server']} ({pk['cpu_server_how']}), latency pick {pk['latency']} "
          f"({pk['latency_how']})", flush=True)
    inputs, input_info = make_inputs(config.spec, args.st_calibration)
    report["inputs"] = input_info
    (work / "inputs.json").write_text(json.dumps(inputs), encoding="utf-8")
    (work / "calibration.txt").write_text("\n".join(inputs["calibration"]) + "\n", encoding="utf-8")

    env_vars = {k: v for n in so_names if n in by for k, v in by[n].env.items()}
    so_env = {**os.environ, **OFFLINE_ENV, **env_vars, "PYTHONPATH": str(HERE.parent / "src")}
    so_cmd = [sys.executable, str(Path(__file__).resolve()), "--servopt-worker", "--run", str(run), "--inputs",
              str(work / "inputs.json"), "--variants", ",".join(so_names)]
    st_names = [b for b in args.st_backends.split(",") if b]
    st = so = None
    try:
        if "speed" in parts:
            ready, env_report = st_env()
            report["st_env"] = env_report
            if ready is None:
                raise SystemExit(f"the sentence-transformers environment could not be made: {env_report['error']}")
            print(f"ST env: {env_report['folder']} ({env_report['size_mb']:.0f} MB, created in {env_report['created_s']:.0f} s)", flush=True)
            print("building ST backends …", flush=True)
            report["st_build"] = build_st(ready, model_dir, work, st_names, args.rebuild, 3600)
            for b, r in report["st_build"]["backends"].items():
                print(f"  {b}: {r['status']}{' (cached)' if r.get('cached') else ''}{'' if r['status'] == 'ok' else ' — ' + str(r.get('error'))[:300]}")
            print("starting the workers …", flush=True)
            st = BlockWorker("sentence-transformers", [str(ready.python), str(PEERS), "worker", "--model", str(model_dir), "--work", str(work),
                                                  "--inputs", str(work / "inputs.json"), "--backends", ",".join(st_names)],
                        st_process_env(ready, work), work / "st-worker.log", work)
            so = BlockWorker("servopt", so_cmd, so_env, work / "servopt-worker.log", HERE.parent)
            st_ready, so_ready = st.answer(1800), so.answer(900)
            report["failed"].update({**st_ready["failed"], **so_ready["failed"]})
            report["workers"] = {"st": st_ready, "servopt": so_ready}
            st_names = [b for b in st_names if b in st_ready["backends"] and b not in st_ready["failed"]]
            so_names = [v for v in so_names if v in so_ready["backends"] and v not in so_ready["failed"]]
            for side in (st_ready, so_ready):
                for n, info in side["backends"].items():
                    report["details"][n] = detail_line(n, info)
            bad = {f"{side['side']}:{n}": t for side in (st_ready, so_ready) for n, t in side["tokens"].items()
                   if set(t["b32x128"]) != {128}}
            report["token_check"] = {"b32x128_all_128_tokens": not bad, "mismatches": bad,
                                     "short_tokens": {n: t["short"] for side in (st_ready, so_ready) for n, t in side["tokens"].items()}}
            if bad:
                print(f"WARNING: the 128-token texts are not 128 tokens for {sorted(bad)}", flush=True)
            if "st-torch" not in st_names:
                raise SystemExit("st-torch (the original) did not load: no quality reference")
            for n in st_names:
                st.ask({"op": "embed", "backend": n, "out": str(work / "emb" / f"{n}.npy")}, 900)
            for n in so_names:
                so.ask({"op": "embed", "backend": n, "out": str(work / "emb" / f"{n}.npy")}, 900)
            report["quality"] = cosines(work / "emb", [*st_names, *so_names], "st-torch")
            print(f"measuring: {len(st_names)} ST backends, {len(so_names)} servopt variants, {args.rounds} rounds …", flush=True)
            blocks = run_speed(st, so, st_names, so_names, args, ncpu)
            report["blocks"] = blocks
            report["speed"] = summarize_speed(blocks, st_names, so_names, report["quality"], pk["cpu_server"], pk["latency"])
            st.stop()
            st = None
        if "serve" in parts:
            if so is None:
                so = BlockWorker("servopt", so_cmd, so_env, work / "servopt-worker.log", HERE.parent)
                so_ready = so.answer(900)
                report["failed"].update(so_ready["failed"])
            print(f"serving: {pk['cpu_server']} over HTTP vs offline, length-aware vs first-come …", flush=True)
            try:
                report["serve"] = run_serve(so, pk["cpu_server"], run, inputs, so_env, work, args, ncpu)
            except Exception as e:  # noqa: BLE001 - the speed part's figures are still written
                report["serve"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        for w in (st, so):
            if w is not None:
                w.stop()
    report["wall_s"] = round(time.time() - started, 1)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1, default=json_default))
    print_report(report)
    print(f"\nfull result: {out_path}")


if __name__ == "__main__":
    main()
