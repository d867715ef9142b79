"""sentence-transformers' ONNX backend as peers (``peers/builtin/sentence_transformers_onnx.py``), up to what needs
its environment (sentence-transformers 5.7.0 with Optimum, about 1.5 GB): the registry finds both from their one file,
their pins, who they apply to, and the pooling the build appends to ST's graph, run here in ONNX Runtime against
ST's own formula (masked mean, then x / max(‖x‖, 1e-12))."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from servopt.contracts import Artifact, ModelRef
from servopt.peers.base import PEERS, PeerInputs, PeerUnavailable
from servopt.peers.builtin.sentence_transformers_onnx import pool_in_graph
from servopt.spec import ModelSpec, TensorSpec

NAMES = ("sentence-transformers-onnx", "sentence-transformers-onnx-int8")


def _token_model(path: Path, vocab: int = 11, hidden: int = 4) -> np.ndarray:
    """A stand-in for ST's export: input_ids, attention_mask → last_hidden_state = an embedding table's rows."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(0).standard_normal((vocab, hidden)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["last_hidden_state"])], "tokens",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", hidden])],
        [numpy_helper.from_array(table, "table")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return table


@pytest.mark.parametrize("normalize", [True, False])
def test_the_appended_pooling_is_sts_masked_mean_and_normalize(tmp_path, normalize):
    import onnxruntime as ort

    table = _token_model(tmp_path / "st.onnx")
    pool_in_graph(tmp_path / "st.onnx", tmp_path / "pooled.onnx", tokens="last_hidden_state", mask="attention_mask",
                  output="embedding", normalize=normalize)
    ids = np.array([[1, 2, 3, 0], [4, 5, 0, 0]], dtype=np.int64)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=np.int64)  # padding must not count
    session = ort.InferenceSession(str(tmp_path / "pooled.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["embedding"]
    got = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    tokens = table[ids] * mask[..., None]
    want = tokens.sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
    if normalize:
        want = want / np.maximum(np.linalg.norm(want, axis=1, keepdims=True), 1e-12)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_graph_without_token_outputs_is_not_this_peers(tmp_path):
    _token_model(tmp_path / "st.onnx")
    with pytest.raises(PeerUnavailable, match="no output 'token_embeddings'"):
        pool_in_graph(tmp_path / "st.onnx", tmp_path / "x.onnx", tokens="token_embeddings", mask="attention_mask",
                      output="embedding", normalize=True)


def test_both_are_registered_from_one_file_share_one_pinned_environment_and_need_a_hf_folder(tmp_path):
    onnx_peer, int8_peer = (PEERS.get(n) for n in NAMES)
    assert onnx_peer.environment() == int8_peer.environment(), "one environment, made once"
    reqs = onnx_peer.environment().requirements
    assert "sentence-transformers==5.7.0" in reqs and any(r.startswith("onnxruntime==") for r in reqs)
    spec = ModelSpec(inputs=[TensorSpec(name="input_ids", dtype="int64", shape=["batch", "sequence"])],
                     outputs=[TensorSpec(name="embedding", dtype="float32", shape=["batch", 4])])
    base = PeerInputs(peer=NAMES[0], run_dir=str(tmp_path), family="text-embedding", spec=spec, evaluation="eval.npz",
                      out=str(tmp_path / "out"), original=Artifact(format="onnx", path="model.onnx"))
    assert onnx_peer.available(base) == (False, "it loads a Hugging Face model folder, and this run's model is not one")
    ok, why = int8_peer.available(base.model_copy(update={"family": "image-classification"}))
    assert not ok and "text-embedding" in why
    folder = base.model_copy(update={"original": Artifact(format="torch", ref=ModelRef(kind="hf_encoder", path=str(tmp_path), spec=spec))})
    assert onnx_peer.available(folder) == (True, "")
