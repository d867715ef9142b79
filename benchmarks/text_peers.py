"""sentence-transformers' own backends for ``benchmarks/text_speed.py``: built with ST's functions, then timed.

Runs INSIDE the sentence-transformers environment (``text_speed.py`` creates it with ``servopt.envs.ensure_env``;
never servopt's venv) and imports nothing from servopt. Two modes:

``build``: what a user of sentence-transformers would do, as its efficiency guide shows, on a copy of the model
folder (``<work>/st-model``), each step in a try so one failure leaves the others:

- ``st-onnx``: ``SentenceTransformer(path, backend="onnx")`` exports with Optimum's default export, then
  ``save_pretrained`` (``onnx/model.onnx``);
- ``st-onnx-int8``: ``export_dynamic_quantized_onnx_model(model, CONFIG, path)`` with ``CONFIG`` = ``"avx512_vnni"``
  when the CPU has AVX512-VNNI, else ``"avx2"``. ST names the file after the preset's weight type
  (``onnx/model_<weights dtype>_<CONFIG>.onnx``: ``model_quint8_avx2.onnx``, ``model_qint8_avx512_vnni.onnx``), so the
  file is read from the folder after the export (``st_int8_file``), never assumed;
- ``st-openvino``: ``SentenceTransformer(path, backend="openvino")`` exports (Optimum Intel's default), then
  ``save_pretrained`` (``openvino/openvino_model.xml``);
- ``st-openvino-int8``: ``export_static_quantized_openvino_model(model, None, path, dataset_name=<local folder>,
  dataset_config_name="default", dataset_split="train", column_name="text")``. Its default calibration set is
  GLUE/SST-2 downloaded from the Hub, which cannot be reached here, so the calibration texts ``text_speed.py`` gives
  (``--calibration``: one text per line) are written as a local ``train.txt`` folder that ``datasets.load_dataset``
  reads offline; everything else is ST's default (``OVQuantizationConfig()``, its tokenization padded to 384 tokens).

``build.json`` records each backend's file, time and error.

``worker``: loads the built backends (plus ``st-torch``: ``SentenceTransformer(path, backend="torch")``; its
``encode`` is decorated with ``torch.inference_mode()``) and answers JSON-lines commands (``serve``): each timed
block calls the backend's own ``model.encode(texts, batch_size=B)`` on one workload, the same loop
(``time_block``) that servopt's worker in ``text_speed.py`` runs, imported from this file.

    <st env python> benchmarks/text_peers.py build  --model DIR --work DIR --calibration calib.txt
    <st env python> benchmarks/text_peers.py worker --work DIR --inputs inputs.json --backends st-torch,st-onnx
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

ST_BACKENDS = ("st-torch", "st-onnx", "st-onnx-int8", "st-openvino", "st-openvino-int8")
WORKLOADS = ("b32x128", "b1short", "texts")  # see workload()
OV_STATIC_SUFFIX = "qint8_quantized"  # export_static_quantized_openvino_model's default file_suffix


# ------------------------------------------------------------------------------ shared by both sides' workers


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine_busy_s() -> float:
    """Busy seconds summed over all CPUs since boot (steal included), from /proc/stat; nan where absent."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def workload(inputs: dict, name: str) -> tuple[list[str], int]:
    """(texts, batch_size) of one workload; every side encodes exactly these texts with this batch size.

    b32x128: 32 texts of exactly 128 tokens, batch 32. b1short: one short sentence, batch 1. texts: the shipped
    sentences with their real lengths, batch 32 (each side batches them its own way: ST's encode sorts by character
    length, servopt by token length). pool:NAME:B: the texts of ``inputs["pools"][NAME]``, batch B."""
    if name.startswith("pool:"):
        _, pool, batch = name.split(":")
        return list(inputs["pools"][pool]), int(batch)
    if name == "b32x128":
        return list(inputs["b32x128"]), 32
    if name == "b1short":
        return [inputs["short"]], 1
    if name == "texts":
        return list(inputs["texts"]), 32
    raise ValueError(f"unknown workload {name!r}")


def time_block(encode: Callable[[list[str], int], np.ndarray], texts: list[str], batch_size: int, *, min_calls: int,
               min_seconds: float, max_seconds: float, warmup: int = 1) -> dict:
    """One timed block: ``encode(texts, batch_size)`` until BOTH ``min_calls`` calls and ``min_seconds`` (or
    ``max_seconds``); each call's time, this process's CPU and the machine's busy CPU over the block."""
    for _ in range(warmup):
        encode(texts, batch_size)
    times: list[int] = []
    busy0, own0 = machine_busy_s(), own_cpu_s()
    start = time.perf_counter_ns()
    min_end, max_end = start + int(min_seconds * 1e9), start + int(max_seconds * 1e9)
    while True:
        t0 = time.perf_counter_ns()
        encode(texts, batch_size)
        t1 = time.perf_counter_ns()
        times.append(t1 - t0)
        if (len(times) >= min_calls and t1 >= min_end) or t1 >= max_end:
            break
    wall = (time.perf_counter_ns() - start) / 1e9
    return {"times_ns": times, "wall_s": wall, "own_cpu_s": own_cpu_s() - own0, "machine_busy_s": machine_busy_s() - busy0,
            "items_per_call": len(texts), "stopped_by": "rule" if len(times) >= min_calls and times and wall >= min_seconds else "max_seconds"}


def protocol_channel():
    """The channel answers go to: the process's original stdout. fd 1 itself is pointed at stderr, so whatever a
    library prints cannot corrupt the protocol."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def serve(backends: dict[str, Callable[[list[str], int], np.ndarray]], inputs: dict, ready: dict, out) -> None:
    """Answer JSON-lines commands on stdin until ``quit``: ``block`` (time one backend on one workload), ``embed``
    (write one backend's embeddings of ``texts`` to an .npy), ``quit``. Every answer is one JSON line."""
    print(json.dumps({"ready": True, **ready}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "quit":
                print(json.dumps({"ok": True}), file=out, flush=True)
                return
            encode = backends[cmd["backend"]]
            if op == "block":
                texts, bs = workload(inputs, cmd["workload"])
                answer = time_block(encode, texts, bs, min_calls=int(cmd["min_calls"]), min_seconds=float(cmd["min_seconds"]),
                                    max_seconds=float(cmd["max_seconds"]), warmup=int(cmd.get("warmup", 1)))
            elif op == "embed":
                emb = np.asarray(encode(list(inputs[cmd.get("key", "texts")]), 32), dtype=np.float32)
                np.save(cmd["out"], emb)
                answer = {"shape": list(emb.shape)}
            else:
                raise ValueError(f"unknown op {op!r}")
            print(json.dumps({"ok": True, **answer}), file=out, flush=True)
        except Exception as e:  # noqa: BLE001 - the controller reports it and goes on
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}), file=out, flush=True)


def warm_and_check(backends: dict, inputs: dict, failed: dict, lengths_of: Callable[[object, list[str]], list[int]] | None,
                   models: dict) -> dict:
    """One call of every workload per backend (a backend that fails is dropped with the reason), and the token
    lengths each backend's own tokenizer gives the fixed-length workloads (the controller checks they are 128)."""
    tokens: dict[str, dict] = {}
    for name in list(backends):
        try:
            for w in WORKLOADS:
                texts, bs = workload(inputs, w)
                backends[name](texts, bs)
            if lengths_of is not None:
                tokens[name] = {"b32x128": lengths_of(models[name], inputs["b32x128"]), "short": lengths_of(models[name], [inputs["short"]])}
        except Exception as e:  # noqa: BLE001
            failed[name] = f"warm-up failed: {type(e).__name__}: {str(e)[:400]}"
            del backends[name]
    return tokens


# ------------------------------------------------------------------------------------------ sentence-transformers


def int8_config_name() -> str:
    """The ST dynamic-INT8 preset for this CPU: avx512_vnni when it has VNNI, else avx2 (what the brief asks)."""
    return "avx512_vnni" if "avx512_vnni" in cpu_flags() else "avx2"


# The weight type of each of Optimum's AutoQuantizationConfig presets (is_static=False), which ST's
# export_dynamic_quantized_onnx_model puts in the file name (file_suffix = f"{weights_dtype.name.lower()}_{preset}").
# Only used to name a file that does not exist yet; an existing file is found in the folder (st_int8_file).
ST_INT8_WEIGHTS = {"arm64": "qint8", "avx2": "quint8", "avx512": "qint8", "avx512_vnni": "qint8"}


def st_int8_file(st_dir: Path, preset: str) -> str:
    """The dynamic-INT8 file ST wrote for ``preset``: ``onnx/model_<weights dtype>_<preset>.onnx`` as found in the
    folder (``model_*_avx512.onnx`` does not match ``…_avx512_vnni.onnx``); before the export, the name the preset's
    weight type gives."""
    found = sorted(p.relative_to(st_dir).as_posix() for p in (st_dir / "onnx").glob(f"model_*_{preset}.onnx"))
    if len(found) > 1:
        raise RuntimeError(f"several dynamic INT8 files for the {preset} preset in {st_dir / 'onnx'}: {found}; remove the stale ones")
    return found[0] if found else f"onnx/model_{ST_INT8_WEIGHTS.get(preset, 'qint8')}_{preset}.onnx"


def st_files(st_dir: Path, preset: str | None = None) -> dict[str, str]:
    """Each ST backend's file in ``st_dir`` (relative); the INT8 one read from the folder (``st_int8_file``)."""
    return {"st-onnx": "onnx/model.onnx", "st-onnx-int8": st_int8_file(st_dir, preset or int8_config_name()),
            "st-openvino": "openvino/openvino_model.xml", "st-openvino-int8": f"openvino/openvino_model_{OV_STATIC_SUFFIX}.xml"}


def build(args) -> None:
    from sentence_transformers import (
        SentenceTransformer,
        export_dynamic_quantized_onnx_model,
        export_static_quantized_openvino_model,
    )

    work = Path(args.work)
    st_dir = work / "st-model"
    if not (st_dir / "config.json").exists():
        shutil.copytree(args.model, st_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("onnx", "openvino", "*.onnx"))
    files = st_files(st_dir)
    wanted = [b for b in args.backends.split(",") if b and b != "st-torch"]
    result: dict[str, dict] = {}

    def step(name: str, fn) -> None:
        if name not in wanted:
            return
        if (st_dir / files[name]).exists() and not args.rebuild:
            result[name] = {"status": "ok", "file": files[name], "cached": True}
            return
        t0 = time.perf_counter()
        try:
            extra = fn() or {}
            files.update(st_files(st_dir))  # the name the export actually wrote
            if not (st_dir / files[name]).exists():
                raise RuntimeError(f"the export finished but {files[name]} is not there: {sorted(str(p.relative_to(st_dir)) for p in st_dir.rglob('*.onnx')) + sorted(str(p.relative_to(st_dir)) for p in st_dir.rglob('*.xml'))}")
            result[name] = {"status": "ok", "file": files[name], "build_s": round(time.perf_counter() - t0, 1), **extra}
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            traceback.print_exc()
            result[name] = {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:800]}", "build_s": round(time.perf_counter() - t0, 1)}
        print(f"[build] {name}: {result[name]['status']}", file=sys.stderr, flush=True)

    def onnx() -> dict:
        (st_dir / "onnx").mkdir(exist_ok=True)
        for stale in (st_dir / "onnx").glob("model.onnx*"):
            stale.unlink()
        model = SentenceTransformer(str(st_dir), backend="onnx", device="cpu", model_kwargs={"export": True})
        model.save_pretrained(str(st_dir))
        return {"call": 'SentenceTransformer(path, backend="onnx") (export), model.save_pretrained(path)'}

    def onnx_int8() -> dict:
        if not (st_dir / files["st-onnx"]).exists():
            raise RuntimeError("st-onnx was not built, and the dynamic INT8 export starts from it")
        model = SentenceTransformer(str(st_dir), backend="onnx", device="cpu", model_kwargs={"file_name": files["st-onnx"]})
        for stale in (st_dir / "onnx").glob(f"model_*_{int8_config_name()}.onnx"):
            stale.unlink()
        export_dynamic_quantized_onnx_model(model, int8_config_name(), str(st_dir))
        return {"call": f'export_dynamic_quantized_onnx_model(model, "{int8_config_name()}", path)', "config": int8_config_name()}

    def openvino() -> dict:
        for stale in (st_dir / "openvino").glob("openvino_model.*") if (st_dir / "openvino").exists() else []:
            stale.unlink()
        model = SentenceTransformer(str(st_dir), backend="openvino", device="cpu", model_kwargs={"export": True})
        model.save_pretrained(str(st_dir))
        return {"call": 'SentenceTransformer(path, backend="openvino") (export), model.save_pretrained(path)'}

    def openvino_int8() -> dict:
        if not (st_dir / files["st-openvino"]).exists():
            raise RuntimeError("st-openvino was not built, and the static INT8 export starts from it")
        texts = [t for t in Path(args.calibration).read_text(encoding="utf-8").split("\n") if t.strip()]
        calib = work / "calibration-dataset"
        calib.mkdir(exist_ok=True)
        (calib / "train.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
        model = SentenceTransformer(str(st_dir), backend="openvino", device="cpu", model_kwargs={"file_name": files["st-openvino"]})
        export_static_quantized_openvino_model(model, None, str(st_dir), dataset_name=str(calib), dataset_config_name="default",
                                               dataset_split="train", column_name="text")
        return {"call": "export_static_quantized_openvino_model(model, None, path, dataset_name=<local folder with the "
                        'calibration texts as train.txt>, dataset_config_name="default", dataset_split="train", column_name="text")',
                "calibration_texts": len(texts),
                "note": "ST's default calibration set (GLUE SST-2 from the Hub) cannot be downloaded here: the calibration "
                        "texts were given as a local dataset folder instead; quantization config: ST's default (OVQuantizationConfig())"}

    step("st-onnx", onnx)
    step("st-onnx-int8", onnx_int8)
    step("st-openvino", openvino)
    step("st-openvino-int8", openvino_int8)
    (work / "build.json").write_text(json.dumps(result, indent=1))


def describe(name: str, model) -> dict:
    """What each ST backend actually runs: versions, threads, ONNX Runtime's providers, OpenVINO's precision."""
    import sentence_transformers
    import torch

    info: dict = {"sentence_transformers": sentence_transformers.__version__, "torch_threads": torch.get_num_threads(),
                  "sorts_by_length_in_encode": True, "length_key": "characters (SentenceTransformer._input_length), longest first"}
    with contextlib.suppress(Exception):  # ST's flash-attention path interleaves long and short texts instead
        info["interleaves_long_and_short"] = bool(model._can_flatten_inputs())
    inner = model.transformers_model
    info["class"] = type(inner).__name__
    if name == "st-torch":
        info["torch"] = torch.__version__
        info["attn_implementation"] = getattr(inner.config, "_attn_implementation", None)
    if name.startswith("st-onnx"):
        import onnxruntime

        sess = getattr(inner, "model", None) or getattr(inner, "session", None)
        info["onnxruntime"] = onnxruntime.__version__
        if sess is not None:
            info["providers"] = sess.get_providers()
            so = sess.get_session_options()
            info["graph_optimization_level"] = str(so.graph_optimization_level)
            info["intra_op_num_threads"] = so.intra_op_num_threads
    if name.startswith("st-openvino"):
        import openvino

        info["openvino"] = openvino.__version__
        info["ov_config"] = {k: str(v) for k, v in (getattr(inner, "ov_config", None) or {}).items()}
        compiled = getattr(inner, "compiled_model", None)
        if compiled is None and getattr(inner, "request", None) is not None:
            req = inner.request
            compiled = req.get_compiled_model() if hasattr(req, "get_compiled_model") else req
        for prop in ("INFERENCE_PRECISION_HINT", "PERFORMANCE_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS", "EXECUTION_MODE_HINT"):
            with contextlib.suppress(Exception):
                value = compiled.get_property(prop)
                info[prop] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)  # ov.Type: "bf16"
    return info


def worker(args) -> None:
    out = protocol_channel()
    from sentence_transformers import SentenceTransformer

    work = Path(args.work)
    st_dir = work / "st-model"
    inputs = json.loads(Path(args.inputs).read_text(encoding="utf-8"))
    files = st_files(st_dir)
    models, backends, failed, infos, load_s = {}, {}, {}, {}, {}
    for name in [b for b in args.backends.split(",") if b]:
        t0 = time.perf_counter()
        try:
            if name == "st-torch":
                model = SentenceTransformer(str(st_dir if st_dir.exists() else args.model), backend="torch", device="cpu")
            else:
                if not (st_dir / files[name]).exists():
                    raise RuntimeError(f"{files[name]} was not built (see build.json)")
                backend = "onnx" if name.startswith("st-onnx") else "openvino"
                model = SentenceTransformer(str(st_dir), backend=backend, device="cpu", model_kwargs={"file_name": files[name]})
            load_s[name] = round(time.perf_counter() - t0, 2)

            def encode(texts: list[str], bs: int, m=model) -> np.ndarray:
                return m.encode(texts, batch_size=bs, show_progress_bar=False, convert_to_numpy=True)

            models[name], backends[name] = model, encode
            infos[name] = {**describe(name, model), "file": files.get(name), "load_s": load_s[name],
                           "max_seq_length": model.max_seq_length}
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {str(e)[:600]}"

    def lengths_of(model, texts: list[str]) -> list[int]:
        return [int(x) for x in np.asarray(model.tokenize(texts)["attention_mask"]).sum(axis=1)]

    tokens = warm_and_check(backends, inputs, failed, lengths_of, models)
    serve(backends, inputs, {"side": "sentence-transformers", "pid": os.getpid(), "backends": infos, "failed": failed,
                             "tokens": tokens}, out)


async def post_timed(session, url: str, body: bytes, headers: dict, lat: list[float], errors: dict[str, int], record: bool) -> None:
    """One HTTP request of a load client (text_servers.py, text_speed.py's serving part); with ``record``, its latency
    (a 200) or its status / exception name (anything else) is kept."""
    import aiohttp

    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as r:
            await r.read()
            status = str(r.status)
    except (aiohttp.ClientError, TimeoutError) as e:
        status = type(e).__name__
    if record and status == "200":
        lat.append((time.perf_counter() - t0) * 1000)
    elif record:
        errors[status] = errors.get(status, 0) + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("build")
    b.add_argument("--model", required=True)
    b.add_argument("--work", required=True)
    b.add_argument("--calibration", required=True, help="calibration texts, one per line (static INT8)")
    b.add_argument("--backends", default=",".join(ST_BACKENDS))
    b.add_argument("--rebuild", action="store_true")
    w = sub.add_parser("worker")
    w.add_argument("--model", required=True)
    w.add_argument("--work", required=True)
    w.add_argument("--inputs", required=True)
    w.add_argument("--backends", default=",".join(ST_BACKENDS))
    args = ap.parse_args()
    build(args) if args.mode == "build" else worker(args)


if __name__ == "__main__":
    main()

