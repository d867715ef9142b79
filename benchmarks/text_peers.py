"""sentence-transformers' own backends for ``benchmarks/text_speed.py``: built with ST's functions, then timed.

Runs INSIDE the sentence-transformers environment (``text_speed.py`` makes it with ``servopt.envs.ensure_env`` and puts
servopt's source on PYTHONPATH for ``servopt.bench.blocks``, stdlib + NumPy: the block protocol both sides answer).

``build``: on a copy of the model folder (``<work>/st-model``), each step in a try, ``build.json`` says what each did:
``st-onnx`` (``SentenceTransformer(path, backend="onnx")`` + ``save_pretrained``), ``st-onnx-int8``
(``export_dynamic_quantized_onnx_model(model, "avx512_vnni" on a VNNI CPU else "avx2", path)``; ST names the file after
the preset's weight type, so it is read from the folder: ``st_int8_file``), ``st-openvino`` (``backend="openvino"``),
``st-openvino-int8`` (``export_static_quantized_openvino_model`` on the calibration texts given as a local dataset
folder: ST's default GLUE/SST-2 cannot be downloaded here; otherwise ST's defaults).

``worker``: loads the built backends (plus ``st-torch``) and answers ``bench.blocks`` commands, each timed block one
``model.encode(texts, batch_size=B)`` loop. (Optimum, Olive and Infinity are peers of ``servopt compare`` now:
``src/servopt/peers/builtin/``.)

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
from pathlib import Path

import numpy as np

from servopt.bench.blocks import answer_blocks, protocol_channel, warm_and_check, workload  # noqa: F401 (workload: tests)

ST_BACKENDS = ("st-torch", "st-onnx", "st-onnx-int8", "st-openvino", "st-openvino-int8")
OV_STATIC_SUFFIX = "qint8_quantized"  # export_static_quantized_openvino_model's default file_suffix


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


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
    answer_blocks(backends, inputs, {"side": "sentence-transformers", "pid": os.getpid(), "backends": infos, "failed": failed,
                             "tokens": tokens}, out)


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

