"""Export any torch source to ONNX, check it, and verify it against torch on real inputs: the one exporter.

Image classifiers and sentence encoders go through the same steps; what differs
is an ``ExportPlan`` made from the model's spec: which axes are dynamic (batch;
batch and sequence for token inputs), the example inputs that trace it, the
inputs it is verified on (several lengths × batches for encoders, padded rows
included) and how close it must stay. The dynamo exporter runs first (torch's
default) and the TorchScript exporter is the fallback, unless a family asks for
the other order (``EXPORT_ORDER``); the report says which one produced the file.
Weights are written inline when the model is under 2 GB (protobuf's limit), so
one file travels. A mismatch past the tolerance fails
loudly rather than producing a subtly wrong model.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from servopt.data.dataset import Dataset, synthetic_inputs
from servopt.errors import UserError
from servopt.models.sources import ONNX_META_SPEC, LoadedModel
from servopt.spec import ModelSpec

log = logging.getLogger(__name__)
PROTOBUF_LIMIT = 2 * 1024**3
TMP_OUTPUT = "servopt_output"  # what the exporters name the output; renamed after export (see name_output)
Exporter = Literal["auto", "dynamo", "torchscript", "torchscript-first"]
# The exporters tried, in order, each falling back to the next. "auto" is torch's default (dynamo) first;
# "torchscript-first" is for graphs both write alike and the TorchScript exporter writes in a fraction of the time (a
# plain CNN: families.image says what was measured), with dynamo behind it for the day torch drops it.
EXPORT_ORDER: dict[Exporter, tuple[str, ...]] = {"auto": ("dynamo", "torchscript"), "dynamo": ("dynamo",),
                                            "torchscript": ("torchscript",), "torchscript-first": ("torchscript", "dynamo")}


class ExportError(UserError):
    pass


@dataclass
class Check:
    """One verification input and how it is named in a failure."""

    feed: dict[str, np.ndarray]
    where: str
    length: int | None = None  # the sequence length it checks (token inputs)


@dataclass
class ExportPlan:
    """What differs between model families at export: dynamic axes, example and verification inputs, tolerance."""

    example: dict[str, np.ndarray]
    axes: dict[int, str]  # dynamic axes of every input: {0: "batch"} or {0: "batch", 1: "sequence"}
    max_sizes: dict[str, int]
    checks: list[Check] = field(default_factory=list)
    real: list[Check] = field(default_factory=list)  # real data (tokenized texts, images): reported on its own
    tolerance: float = 1e-3
    min_cosine: float | None = None  # embeddings: the lowest cosine to torch allowed
    meta: dict[str, Any] = field(default_factory=dict)


def example_token_inputs(spec: ModelSpec, batch: int, length: int, *, seed: int = 0, padded: bool = True) -> dict[str, np.ndarray]:
    """Random token ids of one length; with ``padded``, rows after the first end early (mask 0, pad id), as real batches do."""
    rng = np.random.default_rng(seed)
    vocab = int(spec.extra.get("vocab_size") or 1000)
    pad = int(spec.extra.get("pad_token_id") or 0)
    low = min(1000, vocab // 2)  # BERT vocabularies keep special and unused tokens below 1000
    ids = rng.integers(low, vocab, size=(batch, length), dtype=np.int64)
    mask = np.ones((batch, length), np.int64)
    if padded:
        for row in range(1, batch):
            keep = max(1, length - row * length // (batch + 1))
            mask[row, keep:] = 0
            ids[row, keep:] = pad
    arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros((batch, length), np.int64)}
    return {t.name: arrays[t.name] for t in spec.inputs}


def _spec_meta(spec: ModelSpec) -> dict[str, Any]:
    meta: dict[str, Any] = {"task": spec.task, "family": spec.family, "class_names": spec.class_names,
                            "class_names_from": spec.class_names_from, "output_kind": spec.output_kind,
                            "preprocessing": spec.preprocessing}
    if spec.extra.get("model_type") is not None:  # a sentence encoder: what a reloaded ONNX file needs to serve it
        meta["text"] = {k: spec.extra.get(k) for k in ("model_type", "max_seq_length", "pooling", "normalize", "do_lower_case",
                                                        "pad_token_id")}
    return meta


def token_plan(spec: ModelSpec, *, lengths: Sequence[int] = (7, 32, 128), batches: Sequence[int] = (1, 4),
               tolerance: float = 1e-4, real: Sequence[dict[str, np.ndarray]] = ()) -> ExportPlan:
    """Token inputs (text encoders): batch and sequence dynamic, verified at every length × batch and on real batches."""
    max_positions = int(spec.extra.get("max_positions") or 512)
    checks = [Check(example_token_inputs(spec, b, n, seed=n * 31 + b), f"batch {b} × sequence {n}", n)
              for n in sorted({min(int(n), max_positions) for n in lengths}) for b in batches]
    return ExportPlan(example=example_token_inputs(spec, 2, min(16, max_positions), seed=0), axes={0: "batch", 1: "sequence"},
                      max_sizes={"batch": 4096, "sequence": max_positions}, checks=checks,
                      real=[Check(f, f"verify_inputs[{i}]") for i, f in enumerate(real)], tolerance=tolerance,
                      min_cosine=1 - 1e-4, meta=_spec_meta(spec))


def tensor_plan(spec: ModelSpec, data: Dataset | None = None, tolerance: float = 1e-3) -> ExportPlan:
    """Fixed-shape inputs (images): the batch axis dynamic, verified on up to 16 real (or signature-made) samples."""
    data = data or synthetic_inputs(spec, count=8, seed=1)
    sub = data.subset(np.arange(min(len(data), 16)))
    return ExportPlan(example=synthetic_inputs(spec, count=2).inputs, axes={0: "batch"}, max_sizes={"batch": 4096},
                      checks=[Check({n: sub.inputs[n] for n in spec.input_names}, f"{len(sub)} samples")],
                      tolerance=tolerance, meta=_spec_meta(spec))


def plan_for(spec: ModelSpec, data: Dataset | None = None) -> ExportPlan:
    """The plan a spec calls for: token inputs when its inputs include ``input_ids``, fixed tensors otherwise."""
    if "input_ids" in spec.input_names:
        real = [data.batch(min(8, len(data)))] if data is not None else []
        return token_plan(spec, real=real)
    return tensor_plan(spec, data)


def export_onnx(model: LoadedModel, out_path: Path, *, opset: int = 18, exporter: Exporter = "auto",
                verify_data: Dataset | None = None, tolerance: float | None = None, attention: str = "default") -> dict:
    """Write ``out_path`` from a torch source and return a report: exporter used, opset, checker, verification figures.
    ``attention="eager"``: a Hugging Face encoder exported with eager attention (a plainer graph ONNX Runtime's
    transformer optimizer fuses)."""
    module = model.torch_module()
    if model.kind == "hf_encoder" and attention == "eager":
        from servopt.models.hf_encoder import load_sentence_encoder

        module = load_sentence_encoder(model.path, trust_pickle=model.trust_pickle, attn_implementation="eager")
    plan = plan_for(model.spec, verify_data)
    if tolerance is not None:
        plan.tolerance = tolerance
    return export_module(module, model.spec, out_path, plan, opset=opset, exporter=exporter)


def export_module(module, spec: ModelSpec, out_path: str | Path, plan: ExportPlan, *, opset: int = 18,
                  exporter: Exporter = "auto") -> dict:
    """Export ``module`` as ``plan`` says, name its output as the spec does, write the spec into the file's metadata,
    check it, and verify it against torch (raises ``ExportError`` past the plan's tolerance)."""
    import onnx
    import torch

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    module.eval()  # an exported model is an inference graph: no dropout, in the file or in the torch reference
    names = spec.input_names
    out_name = spec.outputs[0].name if spec.outputs else "logits"
    args = tuple(torch.from_numpy(np.ascontiguousarray(plan.example[n])) for n in names)
    inline = sum(p.numel() * p.element_size() for p in module.state_dict().values() if hasattr(p, "numel")) < PROTOBUF_LIMIT
    report: dict[str, Any] = {"opset": opset, "weights_inline": inline}
    errors: list[str] = []
    used = None
    start = time.perf_counter()
    for which in EXPORT_ORDER[exporter]:
        try:
            if which == "dynamo":
                _export_dynamo(module, args, out_path, names, plan, opset, inline)
            else:
                _export_torchscript(module, args, out_path, names, plan, opset)
                report["opset"] = min(opset, 17)
            used = which
            break
        except Exception as e:  # noqa: BLE001 - any exporter failure falls back to the next; all are reported
            errors.append(f"{which}: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
            log.warning("the %s exporter failed%s: %s", which, ", falling back" if which != EXPORT_ORDER[exporter][-1] else "",
                        errors[-1])
    if used is None:
        raise ExportError("ONNX export failed with every exporter: " + "; ".join(errors),
                          fix="try another --opset or (encoders) eager attention, and report the model to the exporter's maintainers")
    report["exporter"] = used
    report["fallback_reasons"] = errors
    report["export_seconds"] = round(time.perf_counter() - start, 2)

    proto = onnx.load(str(out_path))
    name_output(proto, TMP_OUTPUT, out_name)
    out_dims = proto.graph.output[0].type.tensor_type.shape.dim  # exporters may leave the width symbolic
    if spec.outputs and len(out_dims) == 2 and isinstance(spec.outputs[0].shape[-1], int):
        out_dims[0].dim_param, out_dims[1].dim_value = "batch", int(spec.outputs[0].shape[-1])
    onnx.helper.set_model_props(proto, {ONNX_META_SPEC: json.dumps(plan.meta)})
    if inline:
        onnx.save(proto, str(out_path))
        out_path.with_name(out_path.name + ".data").unlink(missing_ok=True)
    else:
        onnx.save(proto, str(out_path), save_as_external_data=True, location=out_path.name + ".data")
    onnx.checker.check_model(str(out_path))
    report["checker"] = "passed"
    graph_inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    report["inputs"] = graph_inputs
    if sorted(graph_inputs) != sorted(names):
        raise ExportError(f"the exported model takes {sorted(graph_inputs)} but the spec says {sorted(names)}",
                          fix="report the model: an input was dropped or added by the exporter")
    report.update(verify_module(module, spec, out_path, plan))
    return report


def _export_dynamo(module, args: tuple, out_path: Path, names: list[str], plan: ExportPlan, opset: int, inline: bool) -> None:
    import torch

    # The exporter logs a warning per unsupported-op lookup and FutureWarnings: not the user's concern.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    dims = {axis: torch.export.Dim(label, min=1, max=plan.max_sizes[label]) for axis, label in plan.axes.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(out_path), dynamo=True, input_names=names, output_names=[TMP_OUTPUT],
                          opset_version=opset, dynamic_shapes=tuple(dict(dims) for _ in names),
                          external_data=not inline, optimize=True, verbose=False)


def _export_torchscript(module, args: tuple, out_path: Path, names: list[str], plan: ExportPlan, opset: int) -> None:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # aten::index advanced-indexing notes from attention-mask code; deprecation
        torch.onnx.export(module, args, str(out_path), dynamo=False, input_names=names, output_names=[TMP_OUTPUT],
                          opset_version=min(opset, 17),
                          dynamic_axes={**{n: dict(plan.axes) for n in names}, TMP_OUTPUT: {0: "batch"}})


def verify_module(module, spec: ModelSpec, onnx_path: str | Path, plan: ExportPlan, *, strict: bool = True) -> dict:
    """ONNX Runtime against torch on every check of the plan (max |Δ|, lowest cosine, top-1 agreement of 2-D outputs);
    raises ``ExportError`` past the plan's tolerance, or with ``strict=False`` says in ``within_tolerance``."""
    import torch

    from servopt.contracts import Artifact
    from servopt.runtimes import open_session

    session = open_session(Artifact(format="onnx", path=str(onnx_path)), "onnxruntime")

    def compare(check: Check) -> dict[str, float]:
        with torch.inference_mode():
            out = module(*[torch.from_numpy(np.ascontiguousarray(check.feed[n])) for n in spec.input_names])
        ref = (out[0] if isinstance(out, (tuple, list)) else out).float().numpy()
        try:
            got = session.run({n: check.feed[n] for n in spec.input_names})
        except Exception as e:
            raise ExportError(f"the exported model fails on {check.where}: {str(e).splitlines()[0][:300]}",
                              fix="an axis was probably fixed during export; try the other exporter") from e
        if got.shape != ref.shape:
            raise ExportError(f"the exported model gives shape {got.shape} where torch gives {ref.shape} ({check.where})",
                              fix="try the other exporter")
        diff = float(np.abs(got - ref).max())
        scale = max(1.0, float(np.abs(ref).max()))
        figures = {"max_abs_diff": diff}
        if ref.ndim == 2:
            norms = np.maximum(np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1), 1e-12)
            figures["min_cosine"] = float(((got * ref).sum(1) / norms).min())
            figures["top1_agreement"] = float((got.argmax(1) == ref.argmax(1)).mean())
        cos_ok = plan.min_cosine is None or figures.get("min_cosine", 1.0) >= plan.min_cosine
        figures["within_tolerance"] = float(diff <= plan.tolerance * scale and cos_ok)
        if strict and not figures["within_tolerance"]:
            cos = f", min cosine {figures['min_cosine']:.6f}" if "min_cosine" in figures else ""
            raise ExportError(f"the exported model differs from torch on {check.where}: max |Δ| {diff:.3g} "
                              f"(tolerance {plan.tolerance * scale:.3g}){cos}",
                              fix="try the other exporter (or eager attention for encoders), and report the model")
        return figures

    checked = [(c, compare(c)) for c in plan.checks]
    real = [compare(c) for c in plan.real]
    everything = [f for _, f in checked] + real
    report: dict[str, Any] = {"max_abs_diff": max(f["max_abs_diff"] for f in everything)}
    if not strict:
        report["within_tolerance"] = all(f["within_tolerance"] for f in everything)
    if all("min_cosine" in f for f in everything):
        report["min_cosine"] = min(f["min_cosine"] for f in everything)
    if plan.axes.get(1) == "sequence":  # per length, as the encoder tests and the build report show it
        lengths = sorted({c.length for c, _ in checked if c.length is not None})
        report["verification"] = [{"sequence_length": n, "batch_sizes": sorted({len(next(iter(c.feed.values())))
                                                                                 for c, _ in checked if c.length == n}),
                                   "max_abs_diff": max(f["max_abs_diff"] for c, f in checked if c.length == n),
                                   "min_cosine": min(f.get("min_cosine", 1.0) for c, f in checked if c.length == n)}
                                  for n in lengths]
    else:
        report["verify_samples"] = sum(len(next(iter(c.feed.values()))) for c, _ in checked)
        if all("top1_agreement" in f for _, f in checked):
            report["top1_agreement"] = min(f["top1_agreement"] for _, f in checked)
    if real:
        report["verification_real"] = {"batches": len(real), "max_abs_diff": max(f["max_abs_diff"] for f in real),
                                       "min_cosine": min(f.get("min_cosine", 1.0) for f in real)}
    return report


def verify_against_weights(model: LoadedModel, data: Dataset | None = None) -> dict | None:
    """An ONNX sentence encoder whose folder also holds the model's PyTorch weights, run against them (the folder loaded
    as a PyTorch encoder: ``hf_encoder.SentenceEncoder``) at the export's checks (lengths 7, 32, 128; batches 1 and 4)
    and on a batch of ``data``: what its embeddings owe to the export and the pooling servopt appended. None: no
    such weights. Figures, never an error: the ONNX file is what the user serves."""
    folder = model.spec.extra.get("torch_folder")
    if model.kind != "onnx" or not folder:
        return None
    from servopt.models.hf_encoder import load_sentence_encoder

    module = load_sentence_encoder(folder)
    plan = token_plan(model.spec, real=[data.batch(min(8, len(data)))] if data is not None and len(data) else [])
    report = verify_module(module, model.spec, model.path, plan, strict=False)
    weights = model.spec.extra.get("torch_weights") or folder
    return {"weights": Path(weights).name, "checks": len(plan.checks) + len(plan.real), "tolerance": plan.tolerance,
            "min_cosine_bound": plan.min_cosine, **{k: report[k] for k in ("max_abs_diff", "min_cosine", "within_tolerance")
                                                     if k in report}}


def verify_export(model: LoadedModel, onnx_path: Path, data: Dataset, tolerance: float) -> dict:
    """Compare ONNX Runtime against the source model on ``data``; raise past ``tolerance``."""
    plan = plan_for(model.spec, data)
    plan.tolerance = tolerance
    return verify_module(model.torch_module(), model.spec, onnx_path, plan)


def _rename_value(graph, old: str, new: str) -> None:
    for node in graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]
    for vi in (*graph.output, *graph.value_info, *graph.input):
        if vi.name == old:
            vi.name = new


def name_output(proto, current: str, wanted: str) -> None:
    """Rename the graph output ``current`` to ``wanted``, first moving any internal value already called ``wanted``.

    The dynamo exporter names values after their aten op: BERT's token lookup is a value named ``embedding``,
    so asking the exporter for an output named ``embedding`` writes a model ONNX Runtime refuses
    ("Duplicate definition of name (embedding)").
    """
    graph = proto.graph
    if current == wanted:
        return
    taken = {n for node in graph.node for n in (*node.input, *node.output)} | {i.name for i in graph.initializer}
    if wanted in taken:
        fresh = next(f"{wanted}_internal{i}" for i in range(10_000) if f"{wanted}_internal{i}" not in taken)
        _rename_value(graph, wanted, fresh)
    _rename_value(graph, current, wanted)
