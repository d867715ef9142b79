"""Runtimes in Python environments of their own, end to end: the OpenVINO execution provider measured here (its
environment created from PyPI on first use, reused after), a runtime whose environment cannot be made recorded as
failed while the sweep goes on, and `servopt env list`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import channel_mean_onnx
from servopt.bench.jobs import MeasureJob, OpenSpec
from servopt.bench.launcher import launch
from servopt.bench.protocol import Protocol
from servopt.cli import app
from servopt.contracts import Artifact
from servopt.data.dataset import Dataset
from servopt.envs import EnvSpec
from servopt.runtimes import RUNTIMES, get_runtime, register_runtime
from servopt.runtimes.onnxruntime_runtime import OnnxRuntime


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("envs")
    x = np.random.default_rng(0).standard_normal((8, 3, 8, 8)).astype(np.float32)
    Dataset({"input": x}, None, None, "t").save(tmp / "d.npz")
    return channel_mean_onnx(tmp / "m.onnx", size=8), tmp / "d.npz"


@pytest.mark.slow  # creates a virtual environment with pip (5-6 s)
def test_a_runtime_whose_environment_cannot_be_made_fails_with_the_reason(model_and_data, tmp_path):
    model, data = model_and_data

    @register_runtime
    class Unmakeable(OnnxRuntime):
        name = "unmakeable-test"

        def environment(self):
            return EnvSpec(name="unmakeable", requirements=["servopt-no-such-package==1.0"], no_index=True)

    try:
        job = MeasureJob(session=OpenSpec(name="x", artifact=Artifact(format="onnx", path=str(model)), runtime="unmakeable-test"),
                         data=str(data), family="image-classification", protocol=Protocol.quick())
        launched = launch(job, tmp_path / "job")
        assert launched.result is None and "servopt-no-such-package" in launched.error
    finally:
        RUNTIMES.classes.pop("unmakeable-test")


def test_env_list_names_the_declared_environments():
    result = CliRunner().invoke(app, ["env", "list"])
    assert result.exit_code == 0, result.output
    assert "onnxruntime-openvino declares ort-openvino-" in result.output and "onnxruntime-gpu==" in result.output


@pytest.mark.slow
def test_the_openvino_execution_provider_runs_in_its_own_environment(model_and_data, tmp_path):
    """Created from PyPI on first use (about 30 s, 500 MB), reused after; the record names the provider that ran,
    the package versions, and the environment."""
    from servopt.envs import EnvCreationError, ensure_env

    spec = get_runtime("onnxruntime-openvino").environment()
    try:
        ensure_env(spec)
    except EnvCreationError as e:
        if e.offline:
            pytest.skip(f"no package index reachable: {e.problem}")
        raise
    model, data = model_and_data
    job = MeasureJob(session=OpenSpec(name="ep", artifact=Artifact(format="onnx", path=str(model)), runtime="onnxruntime-openvino"),
                     data=str(data), family="image-classification", protocol=Protocol.quick())
    measured = launch(job, tmp_path / "job").result
    assert measured is not None and measured.status == "ok", measured
    env = measured.environment
    assert env.session.provider_actual.startswith("OpenVINOExecutionProvider") and not env.session.provider_fallback
    assert env.libraries["onnxruntime-openvino"] == "1.24.1" and "onnxruntime" not in env.libraries, "the plain build is not there"
    assert env.runtime_env.startswith("ort-openvino-")
    assert "VIRTUAL_ENV=" in (tmp_path / "job" / "replay.sh").read_text()
    listing = CliRunner().invoke(app, ["env", "list"])
    assert "ready" in listing.output and "onnxruntime-openvino" in listing.output
    assert json.loads((tmp_path / "job" / "job.json").read_text())["session"]["runtime"] == "onnxruntime-openvino"


def test_alternating_ratios_are_medians_of_per_round_ratios_scaled_to_the_anchor():
    from servopt.bench.rounds import side_by_side
    from servopt.contracts import Latency, Measured, SideBySide, Throughput

    def m(p50: float, tp: float) -> Measured:
        return Measured(latency_ms=Latency(p50=p50), throughput_ips=Throughput(batch=tp))

    results = {"ref": [m(10, 100), m(20, 50), m(10, 100)], "ep": [m(5, 300), m(10, 100), m(10, 120)]}
    anchor = SideBySide(p50_ms=8, throughput_ips=125, p50_ms_rounds=[8], throughput_rounds=[125], p50_ratio_vs_reference=1,
                        throughput_ratio_vs_reference=1, flagged_rounds=0)
    out = side_by_side(results, "ref", anchor, method="alternating")
    assert out["ep"].p50_ratio_vs_reference == 0.5 and out["ep"].throughput_ratio_vs_reference == 2.0  # medians of (.5,.5,1), (3,2,1.2)
    assert out["ep"].p50_ms == 4.0 and out["ep"].throughput_ips == 250.0 and out["ep"].method == "alternating"


@pytest.mark.slow
def test_a_variant_in_its_own_environment_is_compared_process_by_process(tmp_path, monkeypatch):
    """The sweep cannot run the OpenVINO EP in its interleaved process: it is re-measured alternately with the baseline
    and decided on like any other candidate. (On this 8×8 model the EP's call costs it 5× ONNX Runtime's own p50, so the
    sweep leaves it out of the re-measure as beaten beyond noise, ``candidates.interleave_candidates``; it is made a
    candidate here: how a candidate in an environment of its own is re-measured is what is tested.)"""
    import servopt.optimize.sweep
    from conftest import channel_mean_onnx

    chosen = servopt.optimize.sweep.interleave_candidates
    monkeypatch.setattr(servopt.optimize.sweep, "interleave_candidates",
                        lambda *a, **k: list(dict.fromkeys([*chosen(*a, **k), "ortep-openvino-fp32"])))

    model = channel_mean_onnx(tmp_path / "m.onnx", size=8)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["optimize", str(model), "--input-shape", "input=1x3x8x8", "--out", str(out), "--quick",
                                      "--quiet", "--targets", "cpu-server", "--variants", "ort-fp32",
                                      "--variants", "ortep-openvino-fp32", "--full"])  # no race: it would be screened out
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    ep = summary["interleaved"]["variants"]["ortep-openvino-fp32"]
    assert ep["method"] == "alternating" and len(ep["p50_ms_rounds"]) == 2, ep
    verdict = next(v for v in summary["targets"][0]["verdicts"] if v["variant"] == "ortep-openvino-fp32")
    assert verdict["figures"]["source"] == "interleaved"
    assert "process by process" in (out / "report.md").read_text()
