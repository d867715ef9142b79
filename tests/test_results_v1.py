"""A run directory servopt 0.1 wrote (``tests/fixtures/run-v1``: version-1 summary, records, profiles, and a torch
variant whose model reference lived only in its job file) is read as version 2 and reports."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from servopt.cli import app
from servopt.contracts import RESULT_SCHEMA, SUMMARY_SCHEMA
from servopt.optimize.rundir import load_profile, load_run
from servopt.results import validate_result


def test_a_version_1_run_directory_is_migrated_on_read(run_v1):
    summary, records = load_run(run_v1)
    assert [r.name for r in records] == ["torch-eager", "ort-fp32", "ort-cuda-fp32"]
    assert all(r.schema_ == RESULT_SCHEMA for r in records)
    for r in records:
        validate_result(r.model_dump(mode="json", by_alias=True))  # the documented version-2 schema
    torch_eager, ort, cuda = records
    # The torch artifact: version 1 kept its model reference only in work/<variant>/job.json.
    assert torch_eager.artifact.format == "torch" and torch_eager.artifact.ref.kind == "state_dict"
    assert torch_eager.artifact.ref.arch == "mobilenet_v2" and torch_eager.artifact.ref.spec.class_names[3] == "3"
    assert torch_eager.environment.session.threads == 2 and torch_eager.environment.session.details["mode"] == "eager+inference_mode"
    assert ort.artifact.path.endswith("model.onnx") and ort.artifact.report == {"exporter": "dynamo", "max_abs_diff": 3e-06}
    assert ort.chain[0].pass_name == "export-onnx" and ort.environment.session.threads == "default"
    assert ort.cold_start_s == 0.3 and ort.peak_rss_mb == 95.0 and ort.p50_ms == 2.0 and ort.batch_ips == 1200.0
    assert cuda.status == "skipped" and cuda.needs_gpu and cuda.artifact is None

    assert summary is not None and summary.schema_ == SUMMARY_SCHEMA
    cpu, gpu = summary.targets
    assert cpu.recommended == "ort-fp32" and cpu.result.name == "ort-fp32" and cpu.result.schema_ == RESULT_SCHEMA
    assert cpu.verdict.figures.source == "interleaved" and cpu.verdict.notes == [] and not cpu.verdicts[1].passes
    assert gpu.status == "not measured" and gpu.result is None
    assert summary.interleaved.variants["ort-fp32"].p50_ms == 1.9, "the side-by-side figures are kept (their protocol dropped)"
    assert summary.environment.cpu.startswith("AMD EPYC") and summary.counts == {"ok": 2, "failed": 0, "skipped": 1}


def test_version_1_profiles_are_read(run_v1):
    ok = load_profile(run_v1, "ort-fp32")
    assert ok.profiler == "onnxruntime" and [o.op for o in ok.ops] == ["Conv", "Gemm"] and ok.error is None
    failed = load_profile(run_v1, "torch-eager")
    assert failed.error == "failed: the torch profiler is not available here" and failed.ops == []
    assert load_profile(run_v1, "ort-cuda-fp32") is None


def test_a_version_1_run_directory_reports(run_v1):
    result = CliRunner().invoke(app, ["report", str(run_v1)])
    assert result.exit_code == 0, result.output
    md = (run_v1 / "report.md").read_text()
    assert "| cpu-server |" in md and "ort-fp32" in md
    assert "Conv" in (run_v1 / "report.html").read_text(), "the version-1 profile is shown"
    assert json.loads((run_v1 / "summary.json").read_text())["schema"] == "servopt.summary/1", "reading rewrites nothing"
