"""ONNX export: dynamic batch, inline weights, checker, verification, fallback, metadata."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from typer.testing import CliRunner

from servopt.bench.protocol import Protocol
from servopt.bench.run import bench_model
from servopt.data.dataset import synthetic_inputs
from servopt.export import ExportError, export_onnx, verify_export
from servopt.models.sources import load_model
from servopt.models.zoo import build

pytestmark = pytest.mark.slow  # every test here exports a ResNet-18 (seconds each)


@pytest.fixture(scope="module")
def r18_state(tmp_path_factory):
    path = tmp_path_factory.mktemp("r18") / "r18.pt"
    torch.save(build("resnet18", 4).state_dict(), path)
    return path


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_export_verifies_and_has_dynamic_batch(tmp_path, r18_state, exporter):
    model = load_model(r18_state, arch="resnet18", input_shape={"input": [1, 3, 64, 64]})
    model.spec.class_names, model.spec.output_kind = ["a", "b", "c", "d"], "log-probabilities"  # as --output-kind says
    out = tmp_path / "r18.onnx"
    report = export_onnx(model, out, exporter=exporter, opset=17)
    assert report["exporter"] == exporter and report["checker"] == "passed" and report["weights_inline"]
    assert report["max_abs_diff"] < 1e-3 and report["top1_agreement"] == 1.0
    assert not (tmp_path / "r18.onnx.data").exists()  # weights inline
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        assert sess.run(None, {"input": np.zeros((batch, 3, 64, 64), np.float32)})[0].shape == (batch, 4)
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(meta["servopt.spec"])["class_names"] == ["a", "b", "c", "d"]
    reloaded = load_model(out).spec  # no LogSoftmax in the graph: the kind the user gave travels in the metadata
    assert (reloaded.class_names, reloaded.output_kind) == (["a", "b", "c", "d"], "log-probabilities")


def test_torchscript_first_falls_back_to_dynamo(tmp_path, r18_state, monkeypatch):
    """The image family exports TorchScript first (a CNN's graph alike, in a fraction of the time); where TorchScript
    fails (a model it cannot trace, or a torch without it) dynamo writes the file, and the report says why."""
    import servopt.export as export

    model = load_model(r18_state, arch="resnet18", input_shape={"input": [1, 3, 64, 64]})
    report = export_onnx(model, tmp_path / "ts.onnx", exporter="torchscript-first", opset=18)
    assert report["exporter"] == "torchscript" and report["opset"] == 17 and not report["fallback_reasons"]

    def gone(*_a, **_k):
        raise RuntimeError("the TorchScript exporter was removed")

    monkeypatch.setattr(export, "_export_torchscript", gone)
    report = export_onnx(model, tmp_path / "dyn.onnx", exporter="torchscript-first", opset=18)
    assert report["exporter"] == "dynamo" and report["opset"] == 18 and report["top1_agreement"] == 1.0
    assert report["fallback_reasons"] == ["torchscript: the TorchScript exporter was removed"]


def test_the_image_family_exports_torchscript_first_and_others_keep_torchs_default():
    from servopt.cpu import CpuFeatures
    from servopt.families.catalogue import CatalogueContext
    from servopt.optimize.variants import catalogue
    from servopt.spec import ModelSpec, TensorSpec, image_classifier_spec

    class Source:  # what ``catalogue`` reads of a loaded torch model
        spec, is_torch = image_classifier_spec(3, 64), True

    variants = {v.name: v for v in catalogue(Source(), linear_heavy=False, cpu=CpuFeatures(frozenset({"avx2"})))}
    assert variants["ort-fp32"].chain[0] == ("export-onnx", {"exporter": "torchscript-first"})
    embedding = ModelSpec(inputs=[TensorSpec(name="x", dtype="float32", shape=["batch", 16])], outputs=[TensorSpec(name="y", dtype="float32", shape=["batch", 8])],
                          task="embedding")
    other = CatalogueContext(spec=embedding, is_torch=True, linear_heavy=True, cpu=CpuFeatures(frozenset()))
    assert other.export == [("export-onnx", {})]  # a family on "auto" keeps the step's old parameters (cache keys)


def test_verification_fails_loudly_on_mismatch(tmp_path, r18_state):
    model = load_model(r18_state, arch="resnet18", input_shape={"input": [1, 3, 64, 64]})
    out = tmp_path / "r18.onnx"
    export_onnx(model, out, exporter="torchscript", opset=17)
    with torch.no_grad():  # the torch model drifts from the exported one: verification must catch it
        model.torch_module().fc.bias += 1.0
    with pytest.raises(ExportError, match="differs from torch"):
        verify_export(model, out, synthetic_inputs(model.spec, 4), tolerance=1e-3)


def test_bench_torch_source_measures_both_runtimes(tmp_path, r18_state):
    model = load_model(r18_state, arch="resnet18", input_shape={"input": [1, 3, 64, 64]})
    report = bench_model(model, synthetic_inputs(model.spec, 8), ["torch", "onnxruntime"], Protocol.quick(), tmp_path)
    torch_r, ort_r = report.results
    assert torch_r.status == ort_r.status == "ok"
    assert torch_r.quality.agreement is None  # the reference itself
    assert ort_r.quality.agreement.top1_agreement == 1.0 and ort_r.quality.agreement.max_abs_diff < 1e-3
    assert report.export["exporter"] == "dynamo"
    assert torch_r.environment.session.details["mode"] == "eager+inference_mode"
    assert torch_r.environment.session.precision_actual == "fp32"


def test_export_cli(tmp_path, r18_state):
    from servopt.cli import app

    out = tmp_path / "cli.onnx"
    result = CliRunner().invoke(app, ["export", str(r18_state), "--arch", "resnet18", "--out", str(out),
                                      "--input-shape", "input=1x3x64x64"])
    assert result.exit_code == 0, result.output
    assert '"checker": "passed"' in result.output and out.exists()
    bad = CliRunner().invoke(app, ["export", str(r18_state), "--arch", "resnet18", "--out", str(tmp_path / "x.onnx"),
                                   "--exporter", "jit"])
    assert bad.exit_code != 0 and "'jit' is not an exporter" in bad.output and "torchscript-first" in bad.output
