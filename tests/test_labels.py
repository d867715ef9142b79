"""Issue 41, items 1-2: the class names a model carries map data folders by name, and outputs that are probabilities
are read as they are (confidence, served probabilities). Real small data made here: solid and mixed colour images,
an ONNX classifier whose scores are the channel means (it predicts the dominant colour)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from PIL import Image
from typer.testing import CliRunner

from conftest import LiveServer
from servopt.cli import app
from servopt.data.labels import ModelClasses, folder_indices, imagenet, mapping_note, parse_names
from servopt.errors import UserError
from servopt.families import family_of
from servopt.families.metrics import agreement
from servopt.models.sources import load_model
from servopt.report.data import data_lines

runner = CliRunner()
RGB = {"red": (220, 20, 20), "green": (20, 220, 20), "blue": (20, 20, 220)}
# Colours the channel-mean model is sure of and colours it hesitates over: as probabilities (Softmax, mean 0.5, std
# 0.25) their top-1 p is 0.96-0.99 for the solid ones, 0.5-0.9 for these (where a softmax over probabilities gives
# < 0.5), and under 0.5 for the greys
MIXED = {"red": [(200, 130, 60), (190, 120, 90)], "green": [(120, 190, 70), (100, 200, 110)], "blue": [(90, 90, 200)]}
GREY = [(128, 128, 128), (140, 135, 130)]


def colour_model(path: Path, *, final: str | None = None, axis: int = 1, metadata: dict[str, str] | None = None,
                 flatten_after: bool = False) -> Path:
    """Scores = the per-channel means of a 32×32 image (0 red, 1 green, 2 blue); ``final``: a Softmax/LogSoftmax
    over them, as an exporter that keeps the model's last layer writes it."""
    nodes = [helper.make_node("GlobalAveragePool", ["input"], ["pooled"])]
    if final and flatten_after:  # Softmax over the channel axis of (N, 3, 1, 1), then Flatten: shape-only after it
        nodes += [helper.make_node(final, ["pooled"], ["probs"], axis=axis), helper.make_node("Flatten", ["probs"], ["scores"])]
    elif final:
        nodes += [helper.make_node("Flatten", ["pooled"], ["flat"]), helper.make_node(final, ["flat"], ["scores"], axis=axis)]
    else:
        nodes.append(helper.make_node("Flatten", ["pooled"], ["scores"]))
    graph = helper.make_graph(nodes, "colours", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 32, 32])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if metadata:
        helper.set_model_props(model, metadata)
    onnx.save(model, str(path))
    return path


def colour_folders(root: Path, names: dict[str, str], mislabel: int = 0, mixed: bool = False) -> Path:
    """One folder per colour, named ``names[colour]``; ``mislabel`` red images go into green's folder."""
    for colour, folder in names.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i, rgb in enumerate([RGB[colour]] * 3 + (MIXED[colour] if mixed else [])):
            Image.new("RGB", (40, 36), rgb).save(root / folder / f"{i}.png")
    for i in range(mislabel):
        Image.new("RGB", (40, 36), RGB["red"]).save(root / names["green"] / f"wrong{i}.png")
    if mixed:
        for i, rgb in enumerate(GREY):
            Image.new("RGB", (40, 36), rgb).save(root / names["red"] / f"grey{i}.png")
    return root


def own_accuracy(model: Path, root: Path, index_of: dict[str, int]) -> tuple[int, int]:
    """(correct, total) as the model's own code would count them: resize to 32, scale, normalize, argmax."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    correct = total = 0
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for image in sorted(folder.glob("*.png")):
            x = np.asarray(Image.open(image).convert("RGB").resize((32, 32)), np.float32) / 255
            x = ((x - 0.5) / 0.25).transpose(2, 0, 1)[None]
            correct += int(session.run(None, {"input": x})[0].argmax() == index_of[folder.name])
            total += 1
    return correct, total


def test_names_as_metadata_and_label_files_write_them():
    assert parse_names('["cat", "dog"]') == ["cat", "dog"]
    assert parse_names('{"1": "dog", "0": "cat"}') == ["cat", "dog"]  # Hugging Face's id2label
    assert parse_names("{0: 'person', 1: 'bicycle'}") == ["person", "bicycle"]  # Ultralytics' names
    assert parse_names("0\n90\n180\n270\n") == ["0", "90", "180", "270"]  # PaddleOCR's character
    assert parse_names("0, 90, 180, 270") == ["0", "90", "180", "270"]
    assert parse_names('{"0": "a", "2": "c"}') is None  # a gap: not one name per index
    assert parse_names("  ") is None


def test_folders_map_by_name_never_by_number_unless_told():
    orientation = ModelClasses(("0", "90", "180", "270"), "metadata")
    assert folder_indices(["0", "180", "270", "90"], orientation) == {"0": 0, "180": 2, "270": 3, "90": 1}
    with pytest.raises(UserError) as err:
        folder_indices(["0", "45"], orientation)
    assert "'45'" in err.value.problem and "--labels" in err.value.fix
    colours = ModelClasses(("red", "green", "blue"), "metadata")
    with pytest.raises(UserError, match="both name"):
        folder_indices(["Green", "green"], colours)
    with pytest.raises(UserError) as err:  # a folder named by index needs --labels imagenet
        folder_indices(["2"], colours)
    assert "'2'" in err.value.problem and "--labels imagenet" in err.value.fix


def test_imagenet_list_folders_by_synset_index_or_name():
    net = imagenet()
    assert len(net.names) == len(set(net.synsets)) == 1000
    assert (net.synsets[0], net.names[285], net.names[967]) == ("n01440764", "Egyptian cat", "espresso")
    folders = ["n01440764", "285", "espresso", "tabby_cat", "Great White Shark"]
    assert folder_indices(folders, net) == {"n01440764": 0, "285": 285, "espresso": 967, "tabby_cat": 281,
                                            "Great White Shark": 2}
    with pytest.raises(UserError) as err:  # two ImageNet classes are called crane (the bird, the machine)
        folder_indices(["crane"], net)
    assert "134" in err.value.problem and "517" in err.value.problem and "synset" in err.value.fix


@pytest.mark.parametrize(("metadata", "config", "source"), [
    ({"labels": "red,green,blue"}, None, "metadata 'labels'"),
    ({"id2label": json.dumps({"0": "red", "1": "green", "2": "blue"})}, None, "metadata 'id2label'"),
    ({"names": "{0: 'red', 1: 'green', 2: 'blue'}"}, None, "metadata 'names'"),
    ({"classes": "a,b"}, None, None),  # two names for three outputs: not the classes
    (None, {"id2label": {"0": "red", "1": "green", "2": "blue"}}, "config.json's id2label"),
    (None, {"id2label": {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}}, None),  # transformers' placeholders
])
def test_class_names_a_model_carries(tmp_path, metadata, config, source):
    folder = tmp_path / "onnx"  # Optimum's layout: config.json one folder up
    folder.mkdir()
    if config:
        (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_model(colour_model(folder / "model.onnx", metadata=metadata)).spec
    assert (spec.class_names, spec.class_names_from and source in spec.class_names_from) == (
        (["red", "green", "blue"], True) if source else (None, None))


def test_labels_in_metadata_give_the_models_own_accuracy(tmp_path):
    """Folders named after the model's labels, in an order their sorted names break: `servopt bench` counts what the
    model's own code counts, and says how folders became indices."""
    model = colour_model(tmp_path / "m.onnx", metadata={"labels": "red,green,blue"})
    data = colour_folders(tmp_path / "data", {"red": "red", "green": "green", "blue": "blue"}, mislabel=2)
    correct, total = own_accuracy(model, data, {"red": 0, "green": 1, "blue": 2})
    assert (correct, total) == (9, 11)
    wrong, _ = own_accuracy(model, data, {"blue": 0, "green": 1, "red": 2})  # sorted folder names: what servopt did
    assert wrong == 3
    dataset, spec = _read(model, data)
    assert spec.class_names_from == "the ONNX metadata 'labels'"
    assert dataset.class_names == ["red", "green", "blue"] and "by name" in dataset.meta["labels"]
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", str(model), "--data", str(data), "--resize", "32", "--crop", "32", "--mean",
                                 "0.5,0.5,0.5", "--std", "0.25,0.25,0.25", "--runtime", "onnxruntime", "--min-runs", "2",
                                 "--min-seconds", "0.01", "--batch-size", "4", "--sweep", "1", "--no-cold-start",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    accuracy = json.loads(out.read_text())["results"][0]["quality"]["accuracy"]
    assert (accuracy["correct"], accuracy["total"]) == (correct, total)


def test_unknown_folder_is_an_error_naming_it(tmp_path):
    model = colour_model(tmp_path / "m.onnx", metadata={"labels": "red,green,blue"})
    data = colour_folders(tmp_path / "data", {"red": "red", "green": "green", "blue": "purple"})
    result = runner.invoke(app, ["bench", str(model), "--data", str(data), "--resize", "32", "--crop", "32"])
    assert result.exit_code == 2, result.output
    assert "'purple'" in result.output and "fix:" in result.output and "Traceback" not in result.output


def _read(model: Path, data: Path | None, **options):
    loaded = load_model(model)
    family = family_of(loaded.spec)
    return family.read_whole(loaded.spec, family.data_options({"data": data, "resize": 32, "crop": 32,
                                                               "mean": (0.5,) * 3, "std": (0.25,) * 3, **options}))


def test_labels_file_and_imagenet_and_the_sorted_fallback(tmp_path):
    data = colour_folders(tmp_path / "data", {"red": "r", "green": "g", "blue": "b"})
    bare = colour_model(tmp_path / "bare.onnx")
    dataset, spec = _read(bare, data)  # no names: sorted folder names, as before, and the report says so
    assert dataset.class_names == ["b", "g", "r"] and spec.class_names == ["b", "g", "r"]
    assert dataset.meta["labels"].startswith("by sorted folder name")
    (tmp_path / "labels.txt").write_text("r\ng\nb\n")
    dataset, spec = _read(bare, data, labels=str(tmp_path / "labels.txt"))
    assert list(dataset.labels[::3]) == [2, 1, 0] and spec.class_names == ["r", "g", "b"]  # b, g, r folders
    assert "--labels" in spec.class_names_from
    (tmp_path / "two.txt").write_text("r\ng\n")
    with pytest.raises(UserError, match="2 class names"):
        _read(bare, data, labels=str(tmp_path / "two.txt"))
    with pytest.raises(UserError, match="1000 class names"):
        _read(bare, data, labels="imagenet")


def test_mapping_note_warns_when_sorted_folders_are_fewer_than_outputs():
    note = mapping_note(["cat", "dog"], None, 1000)
    assert "'cat' = 0" in note and "1000 outputs" in note and "--labels" in note
    assert data_lines({"eval": "x", "samples": 3, "labels": note, "outputs": "probabilities (…)"})[1:] == [
        f"classes: {note}", "outputs: probabilities (…)"]


@pytest.mark.parametrize(("final", "axis", "flatten_after", "kind"), [
    ("Softmax", 1, False, "probabilities"), ("Softmax", -1, False, "probabilities"),
    ("LogSoftmax", 1, False, "log-probabilities"), ("Softmax", 1, True, "probabilities"),
    ("Softmax", 0, False, "logits"),  # over the batch: not class probabilities
    (None, 1, False, "logits"),
])
def test_output_kind_read_from_the_graph(tmp_path, final, axis, flatten_after, kind):
    assert load_model(colour_model(tmp_path / "m.onnx", final=final, axis=axis, flatten_after=flatten_after)).spec.output_kind == kind


def test_softmax_models_confident_share_is_the_share_above_the_threshold(tmp_path):
    model = colour_model(tmp_path / "soft.onnx", final="Softmax")
    data = colour_folders(tmp_path / "data", {"red": "red", "green": "green", "blue": "blue"}, mixed=True)
    dataset, spec = _read(model, data)
    assert dataset.outputs == spec.output_kind == "probabilities" and "Softmax" in dataset.meta["outputs"]
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    probs = session.run(None, dataset.inputs)[0]
    top = probs.max(axis=1)
    assert (top > 0.9).sum() >= 9 and ((top > 0.5) & (top < 0.9)).sum() >= 3 and (top < 0.5).sum() >= 2  # all three kinds
    quality = family_of(spec).judge(probs, dataset, probs)
    assert quality.agreement.confident_total == int((top > 0.5).sum())
    as_logits = probs - probs.max(axis=1, keepdims=True)  # what a softmax over probabilities made of them
    flattened = (np.exp(as_logits) / np.exp(as_logits).sum(axis=1, keepdims=True)).max(axis=1)
    assert (flattened > 0.5).sum() < (top > 0.5).sum()
    logits_view, _ = _read(model, data, output_kind="logits")  # --output-kind says otherwise: the values go through a softmax
    assert family_of(spec).judge(probs, logits_view, probs).agreement.confident_total == int((flattened > 0.5).sum())
    assert agreement(probs, probs).top1_agreement == 1.0


def test_classify_answers_with_the_models_names_and_probabilities(tmp_path):
    names = ["0", "90", "180"]  # labels that are numbers: names, not indices
    servopt = {"task": "classification", "preprocessing": {"resize": 32, "crop": 32, "mean": [0.5] * 3, "std": [0.25] * 3}}
    model = colour_model(tmp_path / "m.onnx", final="Softmax",
                         metadata={"character": "\n".join(names), "servopt.spec": json.dumps(servopt)})
    png = tmp_path / "x.png"
    Image.new("RGB", (32, 32), (200, 130, 60)).save(png)
    x = ((np.asarray(Image.open(png).convert("RGB"), np.float32) / 255 - 0.5) / 0.25).transpose(2, 0, 1)[None]
    with LiveServer(model, name="ori") as server:
        expected = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0][0]
        answer = httpx.post(f"{server.url}/v2/models/ori/classify?top_k=3", content=png.read_bytes(),
                            headers={"Content-Type": "image/png"})
    assert answer.status_code == 200, answer.text
    preds = answer.json()["predictions"]
    assert [p["label"] for p in preds] == [names[i] for i in np.argsort(-expected)]
    np.testing.assert_allclose([p["probability"] for p in preds], np.sort(expected)[::-1], rtol=1e-5)
