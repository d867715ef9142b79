"""The lab's exercise 6 for a sentence encoder (issue 8): two deployables of one model, side by side.

From a text run directory it packages (``servopt package``) servopt's cpu-server pick (ONNX Runtime; ``--nearest``
when no variant meets the target) and a PyTorch variant (``--torch-variant``, default ``torch-compile``: the lab's
compiled-PyTorch image), reports each package's installed footprint (``footprint.json``: the serving environment the
package pins, sized from the installed distributions), serves both from their package folders (``servopt serve PKG``,
each its own process, the package's own settings) and sends each ``--requests`` sequential OpenAI ``/v1/embeddings``
requests of one text (the shipped texts, drawn at random, the same draws for both in a round; the load generator's
closed loop of one client, ``servopt.serve.load``), in rounds that alternate the order (A B, B A, ...). The figure is
the mean response time per round, client side, and the median of the per-round ratios. Warm-up requests (``--warmup``)
come first, so a compiling runtime is timed once compiled; its compile shows as the server's start time instead.

    PYTHONPATH=src .venv/bin/python benchmarks/text_deployables.py --run runs/demo-text [--torch-variant torch-compile]
        [--requests 100] [--rounds 3] [--out runs/demo-text/deployables.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from servopt.bench.rounds import ratio_interval, round_order
from servopt.data.text import DEMO_SENTENCES, read_texts
from servopt.machine import header
from servopt.serve.harness import ServerProcess
from servopt.serve.load import Closed, Pool, open_sender, run
from servopt.serve.load.requests import json_request

NAME = "minilm"




def package(run: Path, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "servopt", "package", str(run), "--name", NAME, "--out", str(out), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    manifest = json.loads((out / "manifest.json").read_text())
    footprint = json.loads((out / "footprint.json").read_text())
    return {"variant": manifest["parameters"].get("variant"), "runtime": manifest["runtime"],
            "options": manifest["runtime_options"], "installed_mb": footprint["serving_env"]["installed_mb"],
            "largest": footprint["serving_env"]["largest"][:3]}


def timed(url: str, texts: list[str], n: int, seed: int) -> float:
    """The mean response time (ms) of ``n`` sequential requests of one text each, drawn with ``seed``."""
    async def go() -> float:
        pool = Pool([json_request("/v1/embeddings", {"model": NAME, "input": t}) for t in texts], seed)
        async with open_sender("raw", url) as sender:
            step, _ = await run(sender, pool, Closed(1), 3600.0, max_requests=n)
        if step.ok != n:
            raise RuntimeError(f"{url} answered {step.ok} of {n} requests: {step.errors}")
        return step.latency_ms.mean or 0.0

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, default=Path("runs/demo-text"))
    ap.add_argument("--torch-variant", default="torch-compile")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    texts = read_texts(DEMO_SENTENCES)
    work = Path(tempfile.mkdtemp(prefix="deployables-"))
    sides = {"onnxruntime pick": ["--target", "cpu-server", "--nearest"], "pytorch": ["--variant", args.torch_variant]}
    info, servers, urls = {}, {}, {}
    try:
        for label, extra in sides.items():
            folder = work / label.replace(" ", "-")
            info[label] = package(args.run, folder, *extra)
            servers[label] = ServerProcess(folder, start_timeout_s=600)
            urls[label], info[label]["start_s"] = servers[label].url, servers[label].start_s
        for label in sides:
            timed(urls[label], texts, args.warmup, 0)
        rounds = []
        for r in range(args.rounds):
            rounds.append({label: timed(urls[label], texts, args.requests, r + 1) for label in round_order(list(sides), r)})
    finally:
        for server in servers.values():
            server.stop()
    ratio, lo, hi, _ = ratio_interval([x["pytorch"] / x["onnxruntime pick"] for x in rounds])
    print(f"CPU: {header()} (shared machine); {args.rounds} rounds of {args.requests} sequential "
          f"/v1/embeddings requests of one text per deployable, alternating")
    print(f"{'deployable':18} {'variant':32} {'installed MB':>12} {'start s':>8} {'mean ms per round':>30}")
    for label in sides:
        i = info[label]
        means = ", ".join(f"{x[label]:.2f}" for x in rounds)
        print(f"{label:18} {i['variant']:32} {i['installed_mb']:>12.1f} {i['start_s']:>8.1f} {means:>30}")
    print(f"pytorch / onnxruntime mean response time: {ratio:.2f}x [{lo:.2f}, {hi:.2f}] (median of per-round ratios); installed size "
          f"{info['pytorch']['installed_mb'] / info['onnxruntime pick']['installed_mb']:.2f}x")
    result = {"cpu": header(), "args": {k: str(v) for k, v in vars(args).items()},
              "deployables": info, "rounds": rounds, "pytorch_over_onnxruntime_mean": ratio,
              "interval": [lo, hi]}
    out = args.out or args.run / "deployables.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"full result: {out}")


if __name__ == "__main__":
    main()
