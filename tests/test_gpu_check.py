"""benchmarks/gpu_check.py's CPU side, so the scarce GPU time is not spent finding its bugs: the arguments, the variant
list, the skip reasons, the report, a dry run here (every GPU variant skipped, a report written), and its run path with
CPU runtimes standing in for the GPU ones (slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check
from gpu_check import CUDA, TRT, VARIANTS, Facts, GpuVariant, skip_reason
from servopt.runtimes import get_runtime

GPU = Facts(gpu="NVIDIA H100 80GB HBM3", torch_cuda="", ort="1.24.1", providers=[TRT, CUDA, "CPUExecutionProvider"], tensorrt=True,
            cpu="AMD EPYC 9654 96-Core Processor")


def test_the_variants_are_servopts_own():
    """Every runtime and option is one servopt knows (a typo would surface on the GPU machine only), the reference
    comes first, and each chain names a variant of both demos' catalogues (checked against the names they have)."""
    assert VARIANTS[0].name == "torch-cuda-fp32" and VARIANTS[0].chain_of is None
    assert len({v.name for v in VARIANTS}) == len(VARIANTS)
    for v in VARIANTS:
        get_runtime(v.runtime).parse_options(v.options)
    assert {v.chain_of for v in VARIANTS} - {None} == {"ort-cuda-fp32", "ort-fp16", "ort-tensorrt-fp16", "ort-int8-static-qdq"}
    assert {v.options.get("dtype") for v in VARIANTS if v.runtime == "torch-cuda"} == {None, "fp16"}
    assert any(v.options.get("compile") == "reduce-overhead" for v in VARIANTS), "CUDA graphs where torch offers them"


@pytest.mark.parametrize(("facts", "expected"), [
    ({"gpu": None}, {"no NVIDIA GPU on this machine (nvidia-smi finds none)"}),
    ({"torch_cuda": "torch sees no CUDA device"}, {"torch sees no CUDA device", None}),
    ({"providers": ["CPUExecutionProvider"]}, {None, "this onnxruntime (1.24.1) has no CUDAExecutionProvider: install onnxruntime-gpu"}),
    ({"tensorrt": False}, {None, f"no TensorRT: {TRT} is listed but libnvinfer is not installed"}),
    ({"providers": [CUDA]}, {None, f"no TensorRT: {TRT} is not listed"}),
    ({}, {None}),
    ({"dry_run": True}, {"dry run: it would run here"}),
])
def test_each_variant_is_skipped_with_the_missing_piece(facts, expected):
    reasons = {v.name: skip_reason(v, Facts(**{**GPU.__dict__, **facts})) for v in VARIANTS}
    assert set(reasons.values()) == expected
    if facts.get("tensorrt") is False:
        assert {n for n, r in reasons.items() if r} == {"ort-tensorrt-fp16", "ort-tensorrt-int8"}


def test_the_report_says_what_ran_and_why_not(tmp_path):
    rows = [{"demo": "image", "variant": "ort-cuda-fp16", "status": "ok", "error": None, "provider": CUDA, "precision": "fp16",
             "p50_ms": 0.41234, "batch_per_s": 10234.7, "batch": 32},
            {"demo": "text", "variant": "ort-tensorrt-int8", "status": "skipped", "error": "no TensorRT: a | b"}]
    md = gpu_check.write_report(tmp_path, GPU, rows).read_text()
    assert "GPU: NVIDIA H100 80GB HBM3; CPU: AMD EPYC 9654 96-Core Processor;" in md and "TensorRT library: yes" in md
    assert f"| image | ort-cuda-fp16 | ok | {CUDA} | fp16 | 0.412 | 10235 |  |" in md
    assert "| text | ort-tensorrt-int8 | skipped |  |  |  |  | no TensorRT: a / b |" in md, "a | in a reason cannot break the table"
    saved = json.loads((tmp_path / "gpu-check.json").read_text())
    assert saved["rows"] == rows and saved["facts"]["providers"] == GPU.providers


def test_a_dry_run_here_skips_every_variant_and_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "load_demo", lambda demo: pytest.fail("a dry run loads no model"))
    with pytest.raises(SystemExit):
        gpu_check.main(["--demos", "video"])  # argparse refuses a demo it does not have
    md = gpu_check.main(["--out", str(tmp_path), "--dry-run", "--demos", "image", "text"]).read_text()
    rows = json.loads((tmp_path / "gpu-check.json").read_text())["rows"]
    assert len(rows) == 2 * len(VARIANTS) and {r["status"] for r in rows} == {"skipped"} and all(r["error"] for r in rows)
    assert md.count("| skipped |") == 2 * len(VARIANTS)


@pytest.mark.slow  # builds an export, an fp16 graph and a calibrated INT8 one, and measures each in its own process
def test_the_run_path_on_cpu_stand_ins(tmp_path, monkeypatch, color_folder, tiny_module):
    """The GPU variants' path (the catalogue's chains built with calibration, measured by servopt's job, what ran read
    back) with CPU runtimes in their place and a tiny model in the demo's: an INT8 graph ONNX Runtime runs in INT8 passes,
    one it leaves unfused (ORT_DISABLE_ALL) is recorded failed, and nothing is measured past --max-seconds."""
    import torch

    from servopt.models.sources import load_model

    path = tmp_path / "net.pt"
    torch.save(tiny_module, str(path))
    model = load_model(path, trust_pickle=True, input_shape={"input": [1, 3, 32, 32]})
    monkeypatch.setattr(gpu_check, "load_demo", lambda demo: (model, {"data": color_folder, "resize": 32, "crop": 32}))
    monkeypatch.setattr(gpu_check, "VARIANTS", (
        GpuVariant("torch-fp32", "torch"),
        GpuVariant("ort-int8", "onnxruntime", {"precision": "int8"}, "ort-int8-static-qdq", "ort-cuda"),
        GpuVariant("ort-int8-unfused", "onnxruntime", {"precision": "int8", "graph_optimization_level": "disable"},
                   "ort-int8-static-qdq", "ort-cuda"),
        GpuVariant("ort-fp16", "onnxruntime", {"precision": "fp16"}, "ort-fp16", "ort-cuda")))
    monkeypatch.setattr(gpu_check, "PROTOCOL", {**gpu_check.PROTOCOL, "min_seconds": 0.05, "batch_min_seconds": 0.05,
                                                "min_runs": 5, "batch_min_runs": 3, "batch_size": 4})
    rows = {r["variant"]: r for r in gpu_check.run_demo("image", GPU, tmp_path / "out", deadline=float("inf"))}
    assert rows["torch-fp32"]["status"] == "ok" and rows["torch-fp32"]["p50_ms"] > 0
    assert rows["ort-int8"]["status"] == "ok" and rows["ort-int8"]["precision"].startswith("int8 (QDQ")
    assert rows["ort-int8-unfused"]["status"] == "failed" and "asked for int8 but onnxruntime runs fp32" in rows["ort-int8-unfused"]["error"]
    assert rows["ort-fp16"]["status"] in ("ok", "failed") and rows["ort-fp16"]["precision"]
    late = gpu_check.run_demo("image", GPU, tmp_path / "late", deadline=0.0)
    assert {r["status"] for r in late} == {"skipped"} and "out of time" in late[0]["error"]
