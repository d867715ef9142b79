"""Export any torch source to ONNX, check it, and verify it against torch on real inputs.

The dynamo exporter runs first (torch's default); the TorchScript exporter is
the fallback, and the report says which one produced the file. Weights are
written inline when the model is under 2 GB (protobuf's limit), so one file
travels. A mismatch past the tolerance fails loudly rather than producing a
subtly wrong model.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np

from servopt.data.dataset import Dataset, synthetic_inputs
from servopt.errors import UserError
from servopt.models.sources import ONNX_META_SPEC, LoadedModel

log = logging.getLogger(__name__)
PROTOBUF_LIMIT = 2 * 1024**3


class ExportError(UserError):
    pass


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.state_dict().values() if hasattr(p, "numel"))


def export_onnx(
    model: LoadedModel,
    out_path: Path,
    *,
    opset: int = 18,
    exporter: str = "auto",
    verify_data: Dataset | None = None,
    tolerance: float = 1e-3,
    attention: str = "default",
) -> dict:
    """Write ``out_path`` and return a report: exporter used, opset, checker, verification figures."""
    import onnx
    import torch

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    module = model.torch_module()
    if model.kind == "hf_encoder":  # dynamic batch AND sequence axes, verified at several lengths
        from servopt.models.hf_encoder import export_encoder_onnx, load_sentence_encoder

        if attention == "eager":
            module = load_sentence_encoder(model.path, trust_pickle=model.trust_pickle, attn_implementation="eager")
        feeds = [verify_data.batch(min(8, len(verify_data)))] if verify_data is not None else []
        return export_encoder_onnx(module, model.spec, out_path, opset=opset, exporter=exporter, verify_inputs=feeds)  # type: ignore[arg-type]
    spec = model.spec
    example = synthetic_inputs(spec, count=2)
    args = tuple(torch.from_numpy(example.inputs[t.name]) for t in spec.inputs)
    input_names = spec.input_names
    output_names = [o.name for o in spec.outputs] or ["logits"]
    inline = _param_bytes(module) < PROTOBUF_LIMIT
    report: dict = {"opset": opset, "weights_inline": inline}
    errors: list[str] = []
    used = None
    if exporter in ("auto", "dynamo"):
        # The exporter logs a warning per missing torchvision op and a FutureWarning: not the user's concern.
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
        try:
            batch = torch.export.Dim("batch", min=1, max=4096)
            dyn = tuple({0: batch} for _ in args)
            torch.onnx.export(
                module, args, str(out_path), dynamo=True, input_names=input_names, output_names=output_names,
                opset_version=opset, dynamic_shapes=dyn, external_data=not inline, optimize=True, verbose=False,
            )
            used = "dynamo"
        except Exception as e:  # noqa: BLE001 - any exporter failure falls back
            errors.append(f"dynamo: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
            log.warning("dynamo exporter failed, falling back to TorchScript: %s", errors[-1])
    if used is None and exporter in ("auto", "torchscript"):
        try:
            torch.onnx.export(
                module, args, str(out_path), dynamo=False, input_names=input_names, output_names=output_names,
                opset_version=min(opset, 17), dynamic_axes={n: {0: "batch"} for n in input_names + output_names},
            )
            used = "torchscript"
            report["opset"] = min(opset, 17)
        except Exception as e:  # noqa: BLE001 - reported with the dynamo error
            errors.append(f"torchscript: {str(e).splitlines()[0][:300]}")
    if used is None:
        raise ExportError("ONNX export failed with every exporter: " + "; ".join(errors), fix="see the errors above")
    report["exporter"] = used
    report["fallback_reasons"] = errors
    proto = onnx.load(str(out_path))
    meta = {"task": spec.task, "family": spec.family, "class_names": spec.class_names, "preprocessing": spec.preprocessing}
    onnx.helper.set_model_props(proto, {ONNX_META_SPEC: json.dumps(meta)})
    if inline:
        onnx.save(proto, str(out_path))
        stale = out_path.with_name(out_path.name + ".data")
        stale.unlink(missing_ok=True)
    else:
        onnx.save(proto, str(out_path), save_as_external_data=True, location=out_path.name + ".data")
    onnx.checker.check_model(str(out_path))
    report["checker"] = "passed"
    report.update(verify_export(model, out_path, verify_data or synthetic_inputs(spec, count=8, seed=1), tolerance))
    return report


def verify_export(model: LoadedModel, onnx_path: Path, data: Dataset, tolerance: float) -> dict:
    """Compare ONNX Runtime against torch on the same inputs; raise past ``tolerance``."""
    import torch

    from servopt.contracts import Artifact
    from servopt.runtimes import open_session

    module = model.torch_module()
    sub = data.subset(np.arange(min(len(data), 16)))
    with torch.inference_mode():
        out = module(*[torch.from_numpy(sub.inputs[n]) for n in model.spec.input_names])
    ref = (out[0] if isinstance(out, (tuple, list)) else out).float().numpy()
    got = open_session(Artifact(format="onnx", path=str(onnx_path)), "onnxruntime").run(
        {n: sub.inputs[n] for n in model.spec.input_names})
    diff = float(np.abs(got - ref).max())
    scale = max(1.0, float(np.abs(ref).max()))
    verification = {"verify_samples": len(sub), "max_abs_diff": diff}
    if ref.ndim == 2:
        verification["top1_agreement"] = float((got.argmax(1) == ref.argmax(1)).mean())
    if diff > tolerance * scale:
        raise ExportError(
            f"the exported ONNX model differs from torch by {diff:.3g} (tolerance {tolerance * scale:.3g})",
            fix="try --exporter torchscript or another --opset, and report the model to the exporter's maintainers",
        )
    return verification
