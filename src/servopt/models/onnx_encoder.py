"""ONNX sentence encoders in a Hugging Face folder: Optimum's export, fastembed's models, the hub's ``onnx/`` layout.

Such a folder has ``config.json``, ``tokenizer.json`` and ``model.onnx`` (or ``onnx/model.onnx``), and often the
sentence-transformers files (``modules.json``, ``1_Pooling/config.json``). Its graph usually outputs the token
embeddings (``last_hidden_state``, ``token_embeddings``), which sentence-transformers, fastembed and Optimum's
pipelines pool in Python. servopt appends that pooling (and the L2 normalization ``modules.json`` asks for) to the
graph itself, as ``models.hf_encoder.SentenceEncoder`` puts it inside ``forward`` for PyTorch weights: every variant
built from it then outputs the sentence embedding, and the server only tokenizes. The folder's settings are read by
``hf_encoder.inspect_encoder``, so both paths decide pooling, normalization and lengths the same way.

The graph servopt runs is written once per source file and choice of output to ``$SERVOPT_HOME/onnx-encoders/``
(keyed by their content), with servopt's spec in its metadata so ``servopt serve FILE`` finds the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servopt.errors import UserError
from servopt.home import default_home
from servopt.models.hf_encoder import PROTOBUF_LIMIT, EncoderInfo, encoder_spec, inspect_encoder
from servopt.spec import ModelSpec, TensorSpec

ONNX_FILES = ("model.onnx", "onnx/model.onnx")  # Optimum's and fastembed's layout; the hub's sentence-transformers repos
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # what servopt's tokenizer feeds (data.text.pad_batch)
# Bumped when the graph servopt appends changes: the cached graphs are then written again.
GRAPH_VERSION = 1
_PREFIX = "servopt_pool_"


@dataclass
class OnnxEncoder:
    """An ONNX sentence encoder as found: the folder's settings, the file, and which output holds the embedding."""

    info: EncoderInfo  # the folder's settings (pooling, normalization, lengths, tokenizer); PyTorch weights where present
    source: Path  # the ONNX file as given
    output: str  # the graph output that is the sentence embedding, or the token embeddings it is pooled from
    tokens: bool  # ``output`` is token embeddings [batch, sequence, hidden] (pooled in the graph), not [batch, dim]
    dim: int  # the embedding's size
    inputs: list[str]  # the graph's token inputs, in the order servopt feeds them
    int32_inputs: list[str]  # inputs the graph takes as int32: servopt feeds int64 and the graph casts

    @property
    def pooling_source(self) -> str:
        if not self.tokens:
            return f"the ONNX graph (its output {self.output!r} is the sentence embedding)"
        return f"{self.info.pooling_source}, appended to the ONNX graph after {self.output!r}"


def _readable_config(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and isinstance(config.get("model_type"), str) and (folder / "tokenizer.json").is_file()


def encoder_root(onnx_file: Path) -> Path | None:
    """The Hugging Face folder an ONNX file belongs to (``config.json`` with a ``model_type``, and ``tokenizer.json``):
    the file's own folder, or its parent for the hub's ``onnx/`` sub-folder. None: a plain ONNX file."""
    for folder in (onnx_file.parent, onnx_file.parent.parent) if onnx_file.parent.name == "onnx" else (onnx_file.parent,):
        if _readable_config(folder):
            return folder
    return None


def folder_onnx(folder: Path) -> Path | None:
    """The ONNX file of an encoder folder (None: it is not one). ``model.onnx``, else ``onnx/model.onnx``, else the one
    ``.onnx`` file there (fastembed names some ``model_optimized.onnx``); several others are a ``UserError``."""
    if not folder.is_dir() or not _readable_config(folder):
        return None
    for name in ONNX_FILES:
        if (folder / name).is_file():
            return folder / name
    found = sorted([*folder.glob("*.onnx"), *folder.glob("onnx/*.onnx")])
    if len(found) > 1:
        raise UserError(f"{folder} holds {len(found)} ONNX files and none is model.onnx: "
                        + ", ".join(str(f.relative_to(folder)) for f in found),
                        fix=f"pass the one to optimize, e.g. {found[0]}")
    return found[0] if found else None


def _elem(value_info: Any) -> int:
    return int(value_info.type.tensor_type.elem_type)


def _dims(value_info: Any) -> list[int | str | None] | None:
    tensor = value_info.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]


def _describe(value_info: Any) -> str:
    dims = _dims(value_info)
    return f"{value_info.name} [{', '.join(str(d) for d in dims)}]" if dims is not None else f"{value_info.name} [shape unknown]"


def inspect_onnx_encoder(onnx_file: Path, root: Path, output: str | None = None, trust_pickle: bool = False) -> OnnxEncoder:
    """Read an ONNX encoder: the folder's settings, the graph's token inputs, and the output to embed with (``output``,
    or the graph's only one). Only the graph's structure is read (no weights)."""
    import onnx
    from onnx import TensorProto

    info = inspect_encoder(root, trust_pickle=trust_pickle, weights=False)
    try:
        proto = onnx.load(str(onnx_file), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError, OSError …: all mean "not a readable ONNX file"
        raise UserError(f"{onnx_file} is not a readable ONNX file ({type(e).__name__}: {e})", fix="re-export the model") from e
    graph = proto.graph
    initializers = {i.name for i in graph.initializer}
    inputs = {i.name: i for i in graph.input if i.name not in initializers}
    unknown = [n for n in inputs if n not in TOKEN_INPUTS]
    if unknown or not {"input_ids", "attention_mask"} <= set(inputs):
        raise UserError(
            f"{onnx_file} takes {', '.join(inputs)}; servopt feeds a sentence encoder input_ids and attention_mask "
            "(and token_type_ids where the graph takes them)" + (f", not {', '.join(unknown)}" if unknown else ""),
            fix="export the encoder with those inputs (Optimum's feature-extraction export does)")
    wrong_type = [n for n, v in inputs.items() if _elem(v) not in (TensorProto.INT64, TensorProto.INT32)]
    if wrong_type:
        raise UserError(f"{onnx_file}: token input(s) {', '.join(wrong_type)} are not integers",
                        fix="export the encoder with int64 token inputs")
    outputs = {o.name: o for o in graph.output}
    if output is None:
        if len(outputs) != 1:
            raise UserError(f"{onnx_file} has {len(outputs)} outputs: {'; '.join(_describe(o) for o in graph.output)}",
                            fix="name the sentence embedding with --output NAME (a [batch, dim] output), or the token "
                                "embeddings to pool with the folder's pooling ([batch, sequence, hidden])")
        output = next(iter(outputs))
    elif output not in outputs:
        raise UserError(f"{onnx_file} has no output {output!r}; its outputs: {'; '.join(_describe(o) for o in graph.output)}",
                        fix="pass one of those names to --output")
    dims = _dims(outputs[output])
    if dims is None or len(dims) not in (2, 3):
        shape = "no shape" if dims is None else f"{len(dims)} dimensions"
        raise UserError(f"{onnx_file}'s output {output!r} has {shape}; a sentence encoder's is [batch, dim] (the sentence "
                        "embedding) or [batch, sequence, hidden] (token embeddings, pooled here)",
                        fix="pass the output that holds the embeddings with --output NAME, or re-export with output shapes")
    if _elem(outputs[output]) not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE):
        raise UserError(f"{onnx_file}'s output {output!r} is not floating point", fix="pass the embedding output with --output NAME")
    last = dims[-1]
    dim = last if isinstance(last, int) and last > 0 else info.hidden_size
    tokens = len(dims) == 3
    if tokens and dim != info.hidden_size:
        raise UserError(f"{onnx_file}'s output {output!r} has {dim} features per token but config.json says hidden_size "
                        f"{info.hidden_size}", fix="the folder mixes two models: restore it from the original")
    ordered = [n for n in TOKEN_INPUTS if n in inputs]
    return OnnxEncoder(info=info, source=onnx_file, output=output, tokens=tokens, dim=int(dim), inputs=ordered,
                       int32_inputs=[n for n in ordered if _elem(inputs[n]) == TensorProto.INT32])


# ------------------------------------------------------------------------------------------------- the graph


def _axes(op: str, node_inputs: list[str], out: str, axes: list[int], opset: int, graph: Any, **attrs: Any) -> Any:
    """A ``Reduce*``/``Unsqueeze`` node over ``axes`` in the form ``opset`` wants: ReduceSum and Unsqueeze take their
    axes as an input from opset 13, ReduceMax from 18; an attribute before."""
    from onnx import helper, numpy_helper

    as_input = opset >= (18 if op == "ReduceMax" else 13)
    if not as_input:
        return helper.make_node(op, node_inputs, [out], axes=axes, **attrs)
    import numpy as np

    name = f"{_PREFIX}axes_{'_'.join(str(a).replace('-', 'm') for a in axes)}"
    if name not in {i.name for i in graph.initializer}:
        graph.initializer.append(numpy_helper.from_array(np.array(axes, dtype=np.int64), name))
    return helper.make_node(op, [*node_inputs, name], [out], **attrs)


def append_pooling(model: Any, *, tokens: str, mask: str, output: str, pooling: str, normalize: bool) -> None:
    """Append sentence-transformers' pooling of the ``tokens`` output ([batch, sequence, hidden], over the tokens
    ``mask`` keeps) and, with ``normalize``, its L2 normalization to ``model``'s graph, as ``output`` ([batch, hidden]).
    ``pooling="none"``: ``tokens`` is already the sentence embedding (normalized only). The graph's outputs are not
    changed (``keep_only`` does that).

    Hand-written because no library appends it: sentence-transformers and fastembed pool in Python after the session,
    and Optimum's sentence-transformers export traces the whole PyTorch pipeline. The formulas are those of
    ``hf_encoder.SentenceEncoder.forward`` (ST's): mean = Σ masked / max(count, 1e-9), mean_sqrt_len divides by
    √max(count, 1e-9), max fills padding with -1e9, cls takes the first token; normalize = x / max(‖x‖, 1e-12)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    p = _PREFIX
    graph.initializer.extend([numpy_helper.from_array(np.array(v, dtype=np.float32), p + name)
                              for name, v in (("count_eps", 1e-9), ("norm_eps", 1e-12), ("fill", -1e9), ("zero", 0.0))])
    graph.initializer.append(numpy_helper.from_array(np.array(0, dtype=np.int64), p + "first"))
    nodes = [helper.make_node("Cast", [tokens], [p + "tokens"], to=TensorProto.FLOAT)]  # fp16/bf16 graphs pool in fp32
    pooled = p + "pooled" if normalize else output
    x = p + "tokens"
    if pooling == "none":
        pooled = x if normalize else output
        if not normalize:
            nodes.append(helper.make_node("Identity", [x], [output]))
    elif pooling == "cls":
        nodes.append(helper.make_node("Gather", [x, p + "first"], [pooled], axis=1))
    else:
        nodes += [helper.make_node("Cast", [mask], [p + "mask"], to=TensorProto.FLOAT),
                  _axes("Unsqueeze", [p + "mask"], p + "mask3", [-1], opset, graph)]
        if pooling == "max":
            nodes += [helper.make_node("Greater", [p + "mask3", p + "zero"], [p + "keep"]),
                      helper.make_node("Where", [p + "keep", x, p + "fill"], [p + "filled"]),
                      _axes("ReduceMax", [p + "filled"], pooled, [1], opset, graph, keepdims=0)]
        elif pooling in ("mean", "mean_sqrt_len"):
            nodes += [helper.make_node("Mul", [x, p + "mask3"], [p + "masked"]),
                      _axes("ReduceSum", [p + "masked"], p + "sum", [1], opset, graph, keepdims=0),
                      _axes("ReduceSum", [p + "mask3"], p + "count", [1], opset, graph, keepdims=0),
                      helper.make_node("Max", [p + "count", p + "count_eps"], [p + "count_c"])]
            divisor = p + "count_c"
            if pooling == "mean_sqrt_len":
                nodes.append(helper.make_node("Sqrt", [divisor], [p + "count_sqrt"]))
                divisor = p + "count_sqrt"
            nodes.append(helper.make_node("Div", [p + "sum", divisor], [pooled]))
        else:
            raise UserError(f"unknown pooling {pooling!r}", fix="use mean, cls, max or mean_sqrt_len")
    if normalize:
        nodes += [helper.make_node("Mul", [pooled, pooled], [p + "sq"]),
                  _axes("ReduceSum", [p + "sq"], p + "sqsum", [-1], opset, graph, keepdims=1),
                  helper.make_node("Sqrt", [p + "sqsum"], [p + "norm"]),
                  helper.make_node("Max", [p + "norm", p + "norm_eps"], [p + "norm_c"]),
                  helper.make_node("Div", [pooled, p + "norm_c"], [output])]
    graph.node.extend(nodes)


def keep_only(model: Any, output: str, dim: int | str) -> None:
    """``output`` ([batch, dim] float32) becomes the graph's only output, and what only the others needed (nodes,
    initializers) goes: every runtime runs a graph's first output, and an unused branch would still be computed."""
    from onnx import TensorProto, helper

    graph = model.graph
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", dim]))

    def reads(node: Any) -> set[str]:  # every value a node reads, its subgraphs' too (they read outer values by name)
        found = set(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                for inner in sub.node:
                    found |= reads(inner)
        return found

    needed, kept = {output}, []
    for node in reversed(graph.node):  # a valid graph lists its nodes in topological order
        if needed & set(node.output):
            kept.append(node)
            needed |= reads(node)
    kept.reverse()
    del graph.node[:]
    graph.node.extend(kept)
    used = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(used)


def _cast_inputs(model: Any, names: list[str]) -> None:
    """Inputs the graph takes as int32 become int64 graph inputs, cast inside (servopt's tokenizer feeds int64)."""
    from onnx import TensorProto, helper

    if not names:
        return
    graph = model.graph
    for node in graph.node:
        node.input[:] = [f"{_PREFIX}{n}_int32" if n in names else n for n in node.input]
    casts = [helper.make_node("Cast", [n], [f"{_PREFIX}{n}_int32"], to=TensorProto.INT32) for n in names]
    nodes = [*casts, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    for value in graph.input:
        if value.name in names:
            value.type.tensor_type.elem_type = TensorProto.INT64


def _rename(graph: Any, old: str, new: str) -> bool:
    """Every use of the value ``old`` (nodes, subgraphs' nodes, outputs, initializers, shapes) renamed ``new``; False
    where the graph has no such value."""
    found = False
    for node in graph.node:
        for names in (node.input, node.output):
            if old in names:
                names[:] = [new if n == old else n for n in names]
                found = True
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                found = _rename(sub, old, new) or found
    for value in (*graph.output, *graph.value_info, *graph.initializer):
        if value.name == old:
            value.name, found = new, True
    return found


def _digest(enc: OnnxEncoder, files: list[Path], props: dict[str, str], name: str) -> str:
    """The graph servopt writes, as a key: the source's files (the ONNX file and its external data), every choice made,
    the metadata it carries (the tokenizer's path among them) and its name."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    choice = [GRAPH_VERSION, enc.output, enc.tokens, enc.info.pooling, enc.info.normalize, enc.int32_inputs, enc.dim, props, name]
    h.update(json.dumps(choice, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def sentence_graph(enc: OnnxEncoder, files: list[Path], props: dict[str, str]) -> Path:
    """The file servopt runs: ``enc.source`` (whose files are ``files``) with its pooling and normalization appended,
    int32 inputs cast, the embedding its only output named ``embedding``, ``props`` added to its metadata. Written once
    (atomically) under ``$SERVOPT_HOME/onnx-encoders/<key>/``, named after the model's folder; a later load finds it."""
    import onnx

    name = enc.info.folder.name or "encoder"
    final = default_home() / "onnx-encoders" / _digest(enc, files, props, name) / f"{name}.onnx"
    if final.is_file():
        return final
    model = onnx.load(str(enc.source))  # external data too: the file written holds (or sits beside) its own weights
    _cast_inputs(model, enc.int32_inputs)
    out, tokens = "embedding", enc.output  # the spec's name (what a server answers with)
    if _rename(model.graph, out, f"{_PREFIX}{out}_inner") and tokens == out:  # a graph value of that name moves aside
        tokens = f"{_PREFIX}{out}_inner"
    append_pooling(model, tokens=tokens, mask="attention_mask", output=out,
                   pooling=enc.info.pooling if enc.tokens else "none", normalize=enc.info.normalize)
    keep_only(model, out, enc.dim)
    onnx.helper.set_model_props(model, {p.key: p.value for p in model.metadata_props} | props)
    final.parent.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent.parent))
    try:
        big = sum(len(t.raw_data) for t in model.graph.initializer) > PROTOBUF_LIMIT * 0.9
        onnx.save_model(model, str(tmp / final.name), save_as_external_data=big, all_tensors_to_one_file=True,
                        location=f"{final.name}.data")
        onnx.checker.check_model(str(tmp / final.name))
        try:
            os.replace(tmp, final.parent)  # another process may have written the same graph first: theirs is kept
        except OSError:
            if not final.is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def onnx_encoder_spec(enc: OnnxEncoder) -> ModelSpec:
    """The text family's spec (``hf_encoder.encoder_spec``) with the graph's own token inputs and what was read where."""
    spec = encoder_spec(enc.info)
    spec.inputs = [TensorSpec(name=n, dtype="int64", shape=["batch", "sequence"]) for n in enc.inputs]
    spec.outputs = [TensorSpec(name="embedding", dtype="float32", shape=["batch", enc.dim])]
    spec.extra.update({
        "pooling_source": enc.pooling_source,
        "onnx_source": str(enc.source),
        "onnx_output": enc.output,
        # the same model's PyTorch weights, where the folder has them: `servopt optimize` checks the ONNX against them
        "torch_weights": str(enc.info.weights_path) if enc.info.weights_path else None,
        "torch_folder": str(enc.info.folder) if enc.info.weights_path else None,
    })
    return spec


def spec_meta(spec: ModelSpec) -> dict[str, Any]:
    """What the graph's metadata carries (``sources.ONNX_META_SPEC``): enough for ``servopt serve FILE`` to tokenize."""
    text = {k: spec.extra.get(k) for k in ("model_type", "max_seq_length", "pooling", "normalize", "do_lower_case",
                                           "pad_token_id", "vocab_size", "hidden_size", "num_heads")}
    return {"task": spec.task, "family": spec.family, "class_names": None, "preprocessing": spec.preprocessing, "text": text}
