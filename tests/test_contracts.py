"""Contract tests every registered runtime, pass and model family must pass (NNCF-style templates), and the proof that
a new runtime is one file: registered here, it is opened, measured and served with no change anywhere else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import channel_mean_onnx
from servopt.contracts import QUALITY_KINDS, Artifact, Record, SessionInfo
from servopt.cpu import CpuFeatures
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.families import FAMILIES
from servopt.families.catalogue import CatalogueContext
from servopt.models.sources import load_model
from servopt.optimize.targets import PRESETS
from servopt.passes import PASSES, BuildContext, Pass, build_chain, get_pass, source_artifact
from servopt.passes.base import validate_params
from servopt.runtimes import RUNTIMES, Runtime, RuntimeOptions, Session, get_runtime, open_session, register_runtime
from servopt.spec import ModelSpec, TensorSpec

RUNTIME_NAMES = RUNTIMES.names()
PASS_NAMES = PASSES.names()
# Passes that search or calibrate at length: their contract runs in the slow suite.
SLOW_PASSES = {"ort-quantize-accuracy-aware", "nncf-accuracy-control", "nncf-quantize", "nncf-quantize-onnx",
               "ort-quantize-calibration-search"}


@pytest.fixture(scope="module")
def colour_model(tmp_path_factory) -> Path:
    return channel_mean_onnx(tmp_path_factory.mktemp("contract") / "m.onnx", size=8)


@pytest.fixture(scope="module")
def colour_data() -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24, 3, 8, 8)).astype(np.float32)
    x[np.arange(24), np.arange(24) % 3] += 3.0  # the dominant channel is the label
    return Dataset({"input": x}, np.arange(24) % 3, ["r", "g", "b"], "contract")


def _artifact_for(rt: Runtime, model: Path, tmp: Path) -> Artifact | None:
    if "onnx" in rt.artifact_formats:
        return Artifact(format="onnx", path=str(model))
    if "torch" in rt.artifact_formats:
        import torch

        net = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
        path = tmp / "net.pt2"
        torch.export.save(torch.export.export(net, (torch.zeros(2, 3, 8, 8),), dynamic_shapes=({0: torch.export.Dim("batch")},)),
                          str(path))
        return Artifact(format="torch", ref=load_model(path).ref())
    return None


@pytest.mark.parametrize("name", RUNTIME_NAMES)
def test_runtime_contract(name, colour_model, colour_data, tmp_path):
    rt = get_runtime(name)
    assert rt.name == name and rt.artifact_formats and rt.triton_platform
    ok, why = rt.available()
    assert isinstance(ok, bool) and (ok or why), "an unavailable runtime says why"
    defaults = rt.parse_options({})
    assert isinstance(defaults, RuntimeOptions)
    with pytest.raises(UserError, match="no_such_option"):
        rt.parse_options({"no_such_option": 1})
    if rt.thread_option:
        assert getattr(rt.with_threads(defaults, 1), rt.thread_option) == 1
    assert rt.extra_seconds({}) == 0.0, "default options cost a budget nothing beyond an average measurement"
    if not ok:
        pytest.skip(f"{name} is not available here: {why}")
    if rt.environment() is not None:
        assert rt.environment().requirements, "an environment names what it installs"
        pytest.skip(f"{name} runs in its own Python environment (test_runtime_envs creates it)")
    artifact = _artifact_for(rt, colour_model, tmp_path)
    session = open_session(artifact, name)
    feed = colour_data.slice(0, 4)
    prepared = session.prepare(feed)
    out = session.to_numpy(session.run_prepared(prepared))
    assert out.shape == (4, 3) and np.isfinite(out).all()
    np.testing.assert_allclose(session.run(feed), out, rtol=1e-4, atol=1e-5)
    info = session.info()
    assert isinstance(info, SessionInfo) and info.provider_actual and info.precision_actual
    assert session.warm_up(feed) >= 0.0


@pytest.mark.parametrize("name", PASS_NAMES)
def test_pass_contract(name, colour_model, colour_data, tmp_path, request):
    p = get_pass(name)
    assert p.input_format and p.output_format and p.slow_seconds >= 0.0
    params = validate_params(name, {})
    assert validate_params(name, params.model_dump()).model_dump() == params.model_dump(), "parameters round-trip"
    with pytest.raises(UserError, match="bad parameters"):
        validate_params(name, {"no_such_parameter": 1})
    if name in SLOW_PASSES and "not slow" in (request.config.getoption("-m") or ""):
        pytest.skip("slow pass: runs in `make test`")
    if p.input_format != "onnx":
        pytest.skip("needs a torch source: covered by test_optimize")
    model = load_model(colour_model)
    ctx = BuildContext(source=model, calibration=colour_data, tuning=colour_data)
    try:
        built = build_chain(source_artifact(model), [(name, {})], tmp_path, ctx)
    except UserError as e:  # a pass may refuse this input, but only with an explained error
        assert e.fix, e.problem
        pytest.skip(f"{name} refuses the contract's model (with a fix): {e.problem}")
    assert built.format == p.output_format and Path(built.path).exists()
    again = build_chain(source_artifact(model), [(name, {})], tmp_path, ctx)
    assert again.hash == built.hash and again.path == built.path, "same input + parameters → the cached artifact"
    runtime = "openvino" if built.format == "openvino" else "onnxruntime"
    ok, why = get_runtime(runtime).available()
    if not ok:
        pytest.skip(f"built and cached, not run: {why}")
    assert open_session(built, runtime).run(colour_data.slice(0, 2)).shape == (2, 3)


@pytest.mark.parametrize("name", PASS_NAMES)
def test_pass_describes_its_parameters(name):
    """The report says what each step did in its pass's own words (``Pass.describe``): a pass with parameters either
    writes its words or gives every parameter a description the default reads; an INT8-recipe step says what it did to
    keep accuracy in words of its own, not its name."""
    p = type(get_pass(name))
    params = p.read_params({})
    for report in (None, {}):  # a run without a build report, or an older one's empty report, still reads
        words = p.describe(params, report)
        assert words.strip() and "\n" not in words and "|" not in words, f"{name}: one line for a table cell, got {words!r}"
    if p.describe.__func__ is Pass.describe.__func__:
        undescribed = [f for f, info in p.Params.model_fields.items() if not info.description]
        assert not undescribed, f"{name}: give {undescribed} a Field(description=...) or the pass a describe() of its own"
    if p.int8_recipe:
        assert p.describe(params) != name, f"{name}: an INT8-recipe step says what it did to keep accuracy"


def test_a_pass_without_words_of_its_own_is_described_by_its_parameters():
    from pydantic import Field

    from servopt.passes.base import PassParams

    class Blur(Pass):
        name = "blur"
        input_format = output_format = "onnx"

        class Params(PassParams):
            radius: int = Field(2, description="radius in pixels")
            passes: list[str] = Field(default_factory=list, description="passes over the image")
            sigma: float = 1.0

        def run(self, artifact, params, out_dir, ctx):
            raise NotImplementedError

    assert Blur.describe(Blur.read_params({})) == "blur", "defaults say nothing more than the name"
    assert Blur.describe(Blur.read_params({"radius": 3, "sigma": 0.5})) == "blur (radius in pixels: 3; sigma: 0.5)"
    assert Blur.read_params({"radius": "wide", "gone": 1}).radius == "wide", "an older record's parameters are read, not refused"


@pytest.mark.parametrize("name", FAMILIES.names())
def test_family_contract(name, colour_model, colour_data):
    family = FAMILIES.get(name)
    assert family.name == name and family.task in ("classification", "embedding")
    outputs = colour_data.inputs["input"].mean((2, 3))
    judged = family.judge(outputs, colour_data, outputs)
    assert judged.agreement is not None and judged.agreement.cosine_min == pytest.approx(1.0)
    assert QUALITY_KINDS[judged.kind] is type(judged), "its quality is a registered kind (read back as itself)"
    assert 0.0 <= family.tuning_score(outputs, colour_data, outputs) <= 1.0 and family.tuning_metric(colour_data)
    with pytest.raises(UserError):
        family.data_options({"no_such_flag": 1})
    assert all(f.description for f in family.DataOptions.model_fields.values()), "every data flag says what it is"
    rec = Record(name="v", runtime="onnxruntime", status="ok", quality=judged)
    for target in PRESETS.values():
        checks = family.quality_bounds(target, rec, rec)
        assert checks and all(c.value is not None for c in checks), "the original meets its own quality bounds"
    spec = ModelSpec(inputs=[TensorSpec(name="input", dtype="float32", shape=["batch", 3, 8, 8])],
                     outputs=[TensorSpec(name="out", dtype="float32", shape=["batch", 3])], family=name)
    for is_torch in (False, True):
        variants = family.catalogue(CatalogueContext(spec=spec, is_torch=is_torch, linear_heavy=False, cpu=CpuFeatures(frozenset({"avx2"}))))
        names = [v.name for v in variants]
        assert len(names) == len(set(names)) and sum(v.is_original for v in variants) == 1 and sum(v.is_baseline for v in variants) == 1
        for v in variants:  # every pass and runtime it names exists, and its options are the runtime's
            assert all(p in PASSES.names() for p, _ in v.chain), v.name
            get_runtime(v.runtime).parse_options(v.options)
            assert v.default or v.left_out_why, f"{v.name} is left out without a reason"
            assert v.refines is None or v.refines in names, f"{v.name} refines an unknown variant"


class NumpySession(Session):
    """Runs the channel-mean model in NumPy: a runtime the rest of servopt has never heard of."""

    def __init__(self) -> None:
        self.input_names = ["input"]

    def run_prepared(self, prepared):
        return prepared["input"].mean(axis=(2, 3))

    def info(self) -> SessionInfo:
        return SessionInfo(runtime="numpy-test", provider_requested="numpy", provider_actual="numpy", precision_actual="fp32")


class NumpyOptions(RuntimeOptions):
    threads: int | None = None


def test_a_new_runtime_is_one_registered_class_and_serves(colour_model, colour_data):
    from starlette.testclient import TestClient

    from servopt.serve.model import from_file
    from servopt.serve.rest import create_app

    @register_runtime
    class NumpyRuntime(Runtime):
        name = "numpy-test"
        artifact_formats = ("onnx",)
        Options = NumpyOptions
        thread_option = "threads"
        servable = True
        triton_platform = "numpy_test"

        def open(self, artifact, options):
            return NumpySession()

    try:
        x = colour_data.slice(0, 2)
        np.testing.assert_allclose(open_session(Artifact(format="onnx", path=str(colour_model)), "numpy-test").run(x),
                                   x["input"].mean((2, 3)))
        model = from_file(colour_model, "np", runtime="numpy-test")
        model.apply_instances(2, None)
        assert model.options == {"threads": 1}
        with TestClient(create_app({"np": model})) as client:
            assert client.get("/v2/models/np").json()["platform"] == "numpy_test"
            body = {"inputs": [{"name": "input", "shape": [2, 3, 8, 8], "datatype": "FP32", "data": x["input"].reshape(-1).tolist()}]}
            r = client.post("/v2/models/np/infer", json=body)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(np.asarray(r.json()["outputs"][0]["data"]).reshape(2, 3), x["input"].mean((2, 3)), rtol=1e-5)
    finally:
        RUNTIMES.classes.pop("numpy-test")


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UserError, match="unknown pass 'nope'") as e:
        get_pass("nope")
    assert "ort-quantize-static" in e.value.fix and len(PASSES.classes) >= 10
    with pytest.raises(UserError, match="unknown runtime"):
        get_runtime("tensorflow")


def test_every_measured_figure_has_a_place_in_the_record():
    """``Measured`` (what a worker returns) and ``Record`` (a line of results.jsonl) declare the figures apart, to keep
    the record's field order readable; a figure added to one only would be lost between the worker and the run."""
    from servopt.contracts import Measured, Record

    for name, field in Measured.model_fields.items():
        if name == "status":  # a record also has "skipped"
            continue
        assert name in Record.model_fields, f"Record has no {name}"
        assert Record.model_fields[name].annotation == field.annotation, name
