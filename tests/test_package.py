"""Packages and the paths they name: the serving settings a package records come from ``ServeSettings`` (a text
model keeps its length-aware batching), its requirements from servopt's own declaration, and neither a manifest nor
an ONNX file can make the server read, or ``servopt package`` copy, a file from outside the model's folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from servopt.errors import UserError
from servopt.serve import package as packaging
from servopt.serve.model import from_file, from_package
from servopt.settings import ServeSettings
from test_text_serving import tiny_text_encoder

CHOSEN = ServeSettings(max_batch=8, max_batch_tokens=4096, max_padding=0.5, max_request_samples=100, latency_budget_ms=250,
                       max_queue=64, api_key="not-packaged", port=9999)


@pytest.fixture
def no_wheel(monkeypatch):
    """Packaging builds a wheel of servopt with pip (seconds); these tests are about the manifest and the files."""
    monkeypatch.setattr(packaging, "_build_servopt_wheel", lambda dest: None)


@pytest.fixture(scope="module")
def packaged(tmp_path_factory) -> Path:
    """The tiny text encoder packaged once (without the wheel) with CHOSEN settings; tests copy the folder."""
    root = tmp_path_factory.mktemp("package")
    model = from_file(tiny_text_encoder(root / "src"), "tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packaging, "_build_servopt_wheel", lambda dest: None)
        packaging.package(model, root / "pkg", CHOSEN)
    return root / "pkg"


def _package(tmp_path: Path, packaged: Path) -> Path:
    shutil.copytree(packaged, tmp_path / "pkg")
    return tmp_path / "pkg"


def test_a_packaged_text_model_keeps_its_batching_settings(tmp_path, packaged):
    from starlette.testclient import TestClient

    from servopt.cli.serve import serve_settings
    from servopt.serve.rest import create_app

    chosen, folder = CHOSEN, _package(tmp_path, packaged)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {"max_batch_tokens", "max_padding", "max_request_samples", "latency_budget_ms"} <= manifest["serve"].keys()
    assert not manifest["serve"].keys() & ServeSettings.DEPLOYMENT  # where it listens and its key: the deployment's
    served, packaged = from_package(folder)
    settings = serve_settings(packaged)
    for key in ("max_batch", "max_batch_tokens", "max_padding", "max_request_samples", "latency_budget_ms", "max_queue"):
        assert getattr(settings, key) == getattr(chosen, key), key
    assert settings.api_key is None and settings.port == ServeSettings().port
    # The folder serves alone: the tokenizer named relative to it, the batcher under the packaged token budget.
    assert served.spec.preprocessing["tokenizer"] == str(folder / "model" / "tokenizer.json")
    with TestClient(create_app({served.name: served}, settings)) as client:
        r = client.post(f"/v2/models/{served.name}/embed", json={"texts": ["the cat sat", "a dog"]})
        assert r.status_code == 200, r.text
        assert client.app.state.plane.batchers[served.name].max_batch_tokens == 4096


def test_serving_requirements_are_servopts_own_declaration():
    """The core dependencies and the `serve` extra as pyproject.toml declares them, not a copy that can drift."""
    import tomllib

    project = tomllib.loads((packaging.ROOT / "pyproject.toml").read_text())["project"]
    declared = {packaging._name(r) for r in [*project["dependencies"], *project["optional-dependencies"]["serve"]]}
    got = packaging.serve_requirements()
    assert {packaging._name(r) for r in got} == declared
    assert "uvicorn[standard]" in got  # the extras travel too: they are what makes uvicorn fast
    assert not [r for r in got if any(c in r for c in "<>=~;")]  # names (and extras); pinned when packaged


# --- paths ------------------------------------------------------------------------------------------------------------

def _edit_manifest(folder: Path, edit) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(("field", "value", "words"), [
    ("artifact_file", "../outside.onnx", "is not a path inside"),
    ("artifact_file", "/etc/hostname", "is not a path inside"),
    ("tokenizer", "../tokenizer.json", "is not a path inside"),
    ("tokenizer", "/etc/hostname", "is not a path inside"),
])
def test_a_manifest_names_only_files_inside_its_package(tmp_path, packaged, field, value, words):
    folder = _package(tmp_path, packaged)
    shutil.copy(folder / "model" / "tiny-encoder.onnx", tmp_path / "outside.onnx")
    shutil.copy(folder / "model" / "tokenizer.json", tmp_path / "tokenizer.json")

    def edit(manifest: dict) -> None:
        if field == "tokenizer":
            manifest["spec"]["preprocessing"]["tokenizer"] = value
        else:
            manifest[field] = value

    _edit_manifest(folder, edit)
    with pytest.raises(UserError, match=words) as e:
        from_package(folder)
    assert e.value.fix


def test_a_link_out_of_the_package_is_refused(tmp_path, packaged):
    folder = _package(tmp_path, packaged)
    shutil.copy(folder / "model" / "tiny-encoder.onnx", tmp_path / "elsewhere.onnx")
    (folder / "model" / "link.onnx").symlink_to(tmp_path / "elsewhere.onnx")
    _edit_manifest(folder, lambda m: m.update(artifact_file="model/link.onnx"))
    with pytest.raises(UserError, match="leads outside"):
        from_package(folder)


def _onnx_with_external_data(folder: Path, location: str) -> Path:
    """y = x + w with w stored as external data at ``location`` (relative to the model's folder), the file put there."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    w = numpy_helper.from_array(np.ones((1, 4), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "ext",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "ext.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="w.data", size_threshold=0)
    data = (folder / location).resolve()
    data.parent.mkdir(parents=True, exist_ok=True)
    (folder / "w.data").replace(data)
    proto = onnx.load(str(path), load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(proto, str(path))
    return path


def test_onnx_external_data_stays_in_the_models_folder(tmp_path):
    inside = from_file(_onnx_with_external_data(tmp_path / "ok", "weights/w.data"), "ext")  # a subfolder is inside
    inside.load()
    assert inside.sessions[0].run({"x": np.zeros((1, 4), np.float32)}).tolist() == [[1.0] * 4]
    for location in ("../secret.data", str(tmp_path / "abs" / "w.data")):
        path = _onnx_with_external_data(tmp_path / f"bad{len(location)}", location)
        with pytest.raises(UserError, match="external data of tensor 'w'"):
            from_file(path, "ext")


def test_a_package_never_copies_a_file_from_outside_the_models_folder(tmp_path, no_wheel):
    """Even a ServedModel made without the loader's check: packaging checks every file it copies."""
    from servopt.contracts import Artifact
    from servopt.models.sources import load_model
    from servopt.serve.model import ServedModel

    path = _onnx_with_external_data(tmp_path / "model", "../secret.data")
    model = ServedModel("ext", Artifact(format="onnx", path=str(path)), "onnxruntime", {}, load_model(path).spec)
    with pytest.raises(UserError, match="lies outside"):
        packaging.package(model, tmp_path / "pkg", ServeSettings())
    assert not list((tmp_path / "pkg").rglob("secret.data"))


def test_a_package_keeps_the_external_data_layout(tmp_path, no_wheel):
    """ONNX names external data by its path relative to the model (``weights/w.data``): copied flat, the packaged
    model would name a file that is not there and fail to load."""
    model = from_file(_onnx_with_external_data(tmp_path / "src", "weights/w.data"), "ext")
    packaging.package(model, tmp_path / "pkg", ServeSettings())
    assert (tmp_path / "pkg" / "model" / "weights" / "w.data").is_file()
    served, _ = from_package(tmp_path / "pkg")
    served.load()
    assert served.sessions[0].run({"x": np.zeros((1, 4), np.float32)}).tolist() == [[1.0] * 4]


@pytest.mark.parametrize("content", [b"not a protobuf \xff\xff\xff", b""], ids=["garbage", "empty"])
def test_an_onnx_file_whose_external_data_cannot_be_checked_is_refused(tmp_path, content):
    """Fail closed: a file the check cannot parse is refused with its name, not waved through to a runtime or a
    package copy."""
    from servopt.serve.model import check_external_data

    path = tmp_path / "broken.onnx"
    path.write_bytes(content)
    with pytest.raises(UserError, match=r"broken\.onnx is not a readable ONNX file") as e:
        check_external_data(path)
    assert "re-export" in (e.value.fix or "")
