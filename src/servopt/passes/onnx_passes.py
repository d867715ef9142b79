"""ONNX passes: export, ONNX Runtime offline graph optimization, FP16, dynamic and static INT8.

Quantization uses ONNX Runtime's own tools (``onnxruntime.quantization``): the
formats (QDQ, QOperator), types (U8S8 vs U8U8 matter a lot on CPUs without
VNNI) and calibration methods are theirs; servopt only chooses and measures.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from servopt.contracts import Artifact
from servopt.cpu import Int8Kernel
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.export import Exporter
from servopt.passes.base import BuildContext, Pass, PassOutput, PassParams, register_pass

log = logging.getLogger(__name__)


@register_pass
class ExportOnnx(Pass):
    """torch → ONNX with verification (``servopt.export``)."""

    name = "export-onnx"
    reads_data = False  # the exported model is the same whatever data verifies it
    input_format = "torch"
    output_format = "onnx"

    class Params(PassParams):
        opset: int = Field(18, description="ONNX opset")
        exporter: Exporter = Field("auto", description="exporter (export.EXPORT_ORDER)")
        # Text encoders: "eager" exports plain attention (the graph ONNX Runtime's transformer optimizer fuses).
        attention: Literal["default", "eager"] = Field("default", description="attention exported")

    def run(self, artifact: Artifact, params: Params, out_dir: Path, ctx: BuildContext) -> PassOutput:
        from servopt.export import export_onnx
        from servopt.models.sources import LoadedModel

        model = LoadedModel.from_ref(artifact.ref)
        report = export_onnx(model, out_dir / "model.onnx", opset=params.opset, exporter=params.exporter,
                             verify_data=ctx.calibration, attention=params.attention)
        return PassOutput(format="onnx", file="model.onnx", report=report)


@register_pass
class OrtTransformersOptimize(Pass):
    """ONNX Runtime's transformer optimizer (``onnxruntime.transformers.optimizer``): fuses attention, LayerNorm,
    GELU and embeddings into ORT's contrib operators; the report lists which fusions applied."""

    name = "ort-transformers-optimize"
    reads_data = False
    input_format = "onnx"
    output_format = "onnx"

    class Params(PassParams):
        # the fusion patterns (BERT covers MiniLM/BGE/E5)
        model_type: Literal["bert", "bart", "gpt2", "vit", "t5"] = Field("bert", description="fusion patterns")
        # 0: the Python fusions only; ONNX Runtime applies its own graph optimizations at load
        opt_level: int = Field(0, description="optimizer level")
        # Also make the fusions whose CPU kernels are slower than what they replace (a graph for a GPU provider); the
        # CPU provider does not make them either (onnxruntime_runtime.CPU_SLOW_FUSIONS says which and why).
        cpu_slow_fusions: bool = Field(False, description="fusions slower on CPU made too")

    def run(self, artifact: Artifact, params: Params, out_dir: Path, ctx: BuildContext) -> PassOutput:
        extra = ctx.source.spec.extra
        heads, hidden = int(extra.get("num_heads") or 0), int(extra.get("hidden_size") or 0)  # 0: detected from the graph
        fused = fuse_transformer(Path(artifact.path), out_dir / "model.onnx", params, heads, hidden)
        return PassOutput(format="onnx", file="model.onnx", report={"fusions": fused, "model_type": params.model_type})


def fuse_transformer(src: Path, dst: Path, params: OrtTransformersOptimize.Params, heads: int = 0, hidden: int = 0) -> dict[str, int]:
    """Write ``dst``: ``src`` through ONNX Runtime's transformer optimizer; returns the fusions made (operator → count)."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    from servopt.runtimes.onnxruntime_runtime import CPU_SLOW_FUSIONS

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    fusions = FusionOptions(params.model_type)
    for flag in () if params.cpu_slow_fusions else CPU_SLOW_FUSIONS.values():
        setattr(fusions, flag, False)
    optimized = optimize_model(str(src), model_type=params.model_type, num_heads=heads, hidden_size=hidden,
                               opt_level=params.opt_level, optimization_options=fusions)
    optimized.save_model_to_file(str(dst))
    return {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}


@register_pass
class OrtGraphOffline(Pass):
    """Save the graph ONNX Runtime optimized, to load later with optimizations disabled (faster start)."""

    name = "ort-graph-offline"
    reads_data = False
    input_format = "onnx"
    output_format = "onnx"

    class Params(PassParams):
        level: Literal["basic", "extended", "all"] = Field("all", description="graph optimization level")

    def run(self, artifact: Artifact, params: Params, out_dir: Path, ctx: BuildContext) -> PassOutput:
        from servopt.runtimes import open_session

        out = out_dir / "model.onnx"
        open_session(artifact, "onnxruntime", {"graph_optimization_level": params.level, "optimized_model_filepath": str(out)})
        return PassOutput(format="onnx", file="model.onnx", report={"level": params.level, **stamp_nchwc_block(out)})


NCHWC_DOMAIN = "com.microsoft.nchwc"


def stamp_nchwc_block(path: Path) -> dict[str, int]:
    """Mark a graph ONNX Runtime saved in its NCHWc layout with the block this CPU wrote it in (model metadata
    ``NCHWC_BLOCK_KEY``, read back at every load by ``runtimes.onnxruntime_runtime.check_nchwc_block``, and in the
    report, which ``decide`` holds against a target's CPU): ONNX Runtime itself neither records nor checks it."""
    import onnx

    from servopt.machine import host_features
    from servopt.runtimes.onnxruntime_runtime import NCHWC_BLOCK_KEY

    model = onnx.load(str(path))
    nodes = sum(n.domain == NCHWC_DOMAIN for n in model.graph.node)
    block = host_features().nchwc_block  # what MLAS used here: the host's flags, never servopt's capped reading
    if not nodes or block is None:
        return {}
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, NCHWC_BLOCK_KEY: str(block)})
    onnx.save(model, str(path))
    return {"nchwc_nodes": nodes, "nchwc_block": block}


@register_pass
class Fp16(Pass):
    """FP16 weights and compute, float32 inputs/outputs kept: half the size, for edge targets."""

    name = "fp16"
    reads_data = False
    input_format = "onnx"
    output_format = "onnx"

    class Params(PassParams):
        keep_io_types: bool = Field(True, description="float32 inputs and outputs kept")

    def run(self, artifact: Artifact, params: Params, out_dir: Path, ctx: BuildContext) -> PassOutput:
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = convert_float_to_float16(onnx.load(str(artifact.path)), keep_io_types=params.keep_io_types)
        onnx.save(model, str(out_dir / "model.onnx"))
        return PassOutput(format="onnx", file="model.onnx")


QTYPES = {"U8": "QUInt8", "S8": "QInt8"}
# Tensors whose type shape inference cannot tell (outputs of ORT's fused contrib operators: Attention,
# SkipLayerNormalization …) are float: without this, dynamic INT8 of a transformer-optimized graph fails.
DYNAMIC_EXTRA = {"DefaultTensorType": 1}  # onnx.TensorProto.FLOAT


@register_pass
class OrtQuantizeDynamic(Pass):
    """Dynamic INT8: weights quantized ahead, activations at run time (good for Linear-heavy models)."""

    name = "ort-quantize-dynamic"
    reads_data = False  # activation ranges are taken at run time
    input_format = "onnx"
    output_format = "onnx"

    class Params(PassParams):
        weight_type: Literal["S8", "U8"] = "S8"
        per_channel: bool = False
        reduce_range: bool = False  # 7-bit weights: U8S8 cannot saturate on x86 without VNNI
        # The transformer FFN's output projections (the MatMuls a GELU feeds) kept in float: GELU's long tail stretches
        # a per-tensor u8 range so far that the small values between lose their precision (see docs/text.md, MPNet).
        float_ffn_output: bool = False
        op_types: list[str] = Field(default_factory=list)  # the operator types to quantize; empty: ONNX Runtime's default

    int8_recipe = True

    @classmethod
    def int8_kernel(cls, params: Params) -> Int8Kernel:  # activations are u8 at run time
        return "u8u8" if params.weight_type == "U8" else "u8s8-7bit" if params.reduce_range else "u8s8"

    @classmethod
    def describe(cls, params: Params, report: dict | None = None) -> str:
        return "dynamic (activation ranges at run time)" + (", 7-bit weights" if params.reduce_range else "")

    def run(self, artifact: Artifact, params: Params, out_dir: Path, ctx: BuildContext) -> PassOutput:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        src = strip_value_info(str(artifact.path), out_dir)
        kept = gelu_fed_matmuls(src) if params.float_ffn_output else []
        quantize_dynamic(src, str(out_dir / "model.onnx"), weight_type=getattr(QuantType, QTYPES[params.weight_type]),
                         per_channel=params.per_channel, reduce_range=params.reduce_range, extra_options=DYNAMIC_EXTRA,
                         op_types_to_quantize=params.op_types or None, nodes_to_exclude=kept or None)
        Path(src).unlink(missing_ok=True)
        report = {"float_ffn_output": len(kept)} if params.float_ffn_output else None  # + its U8S8 overflow (build_chain)
        return PassOutput(format="onnx", file="model.onnx", report=report)


GELU = {"Erf", "Gelu", "FastGelu", "BiasGelu", "QuickGelu"}


def gelu_fed_matmuls(path: str, depth: int = 5) -> list[str]:
    """The MatMul nodes whose input comes from a GELU within ``depth`` nodes (its erf form is Div, Erf, Add, Mul, Mul):
    a transformer FFN's output projections."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    producer = {out: n for n in graph.node for out in n.output}

    def fed_by_gelu(name: str, left: int) -> bool:
        node = producer.get(name)
        if node is None or left == 0 or node.op_type == "MatMul":
            return False
        return node.op_type in GELU or any(fed_by_gelu(i, left - 1) for i in node.input)

    return [n.name for n in graph.node if n.op_type == "MatMul" and n.name and fed_by_gelu(n.input[0], depth)]


def strip_value_info(src: str, out_dir: Path) -> str:
    """A copy without intermediate value_info: exporters sometimes leave stale shapes there that make
    ONNX Runtime's quantizer fail its shape inference ("Inferred shape and existing shape differ")."""
    import onnx

    model = onnx.load(src)
    del model.graph.value_info[:]
    out = out_dir / "no_value_info.onnx"
    onnx.save(model, str(out))
    return str(out)


class CalibrationReader:
    """Feeds calibration samples one at a time to ONNX Runtime's calibrators."""

    def __init__(self, data: Dataset, count: int) -> None:
        self.samples = [data.slice(i, i + 1) for i in range(min(count, len(data)))]
        self.index = 0

    def get_next(self) -> dict | None:
        if self.index >= len(self.samples):
            return None
        self.index += 1
        return self.samples[self.index - 1]

    def rewind(self) -> None:
        self.index = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self):  # ORT's debugging tools iterate instead of calling get_next
        return iter(self.samples)


class StaticParams(PassParams):
    quant_format: Literal["QDQ", "QOperator"] = "QDQ"
    activation_type: Literal["U8", "S8"] = "U8"
    weight_type: Literal["S8", "U8"] = "S8"
    per_channel: bool = True
    calibrate_method: Literal["MinMax", "Entropy", "Percentile"] = "MinMax"
    calibration_samples: int = 100
    reduce_range: bool = False
    nodes_to_exclude: list[str] = Field(default_factory=list)

    def int8_kernel(self) -> Int8Kernel:
        """ONNX Runtime's quantizer (1.32) writes per-channel conv weights as s8 even when asked for U8: per-channel
        "U8U8" runs U8S8 on every conv (tests/test_int8_overflow.py)."""
        if self.activation_type == "S8":
            return "s8s8"
        if self.weight_type == "U8" and not self.per_channel:
            return "u8u8"
        return "u8s8-7bit" if self.reduce_range else "u8s8"


# Where ONNX Runtime's symbolic shape inference saves a model whose shapes it could not complete, before it raises:
# the working directory, with the weights beside it as a uuid-named .data file (90 MB each for MiniLM; every text
# encoder exported with dynamic axes ends there). One lock: two builds in parallel would write the same name.
SYMBOLIC_LEFTOVER = "sym_shape_infer_temp.onnx"
_PREPROCESS_LOCK = threading.Lock()


def preprocess_for_quantization(src: str, out_dir: Path) -> str:
    """ONNX Runtime's recommended pre-processing (shape inference, folding); the original if it fails. Whatever the
    library leaves in the working directory when it fails is removed, and so is the copy it read: a build writes only
    its own folder, and keeps there only what it made (the caller removes ``preprocessed.onnx`` once quantized)."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = out_dir / "preprocessed.onnx"
    with _PREPROCESS_LOCK:
        started = time.time()
        try:
            quant_pre_process(strip_value_info(src, out_dir), str(pre))
            return str(pre)
        except Exception as e:  # noqa: BLE001 - the pre-processing is an optimization, not a requirement
            log.warning("quantization pre-processing skipped: %s", e)
            return src
        finally:
            (out_dir / "no_value_info.onnx").unlink(missing_ok=True)  # read only by the pre-processing (a full copy)
            remove_symbolic_leftover(started)


def remove_symbolic_leftover(since: float, folder: Path | None = None) -> list[Path]:
    """Delete ``SYMBOLIC_LEFTOVER`` and the external-data files it names from ``folder`` (the working directory), if
    written at or after ``since`` (so a user's own older file of that name stays); returns what was deleted."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    try:
        folder = folder or Path.cwd()
        model_file = folder / SYMBOLIC_LEFTOVER
        if not model_file.is_file() or model_file.stat().st_mtime < since - 1:
            return []
        model = onnx.load(str(model_file), load_external_data=False)
    except Exception:  # noqa: BLE001 - a cwd gone or a file half-written: nothing this build can safely remove
        return []
    names = {ExternalDataInfo(t).location for t in model.graph.initializer if uses_external_data(t)}
    removed = []
    for path in [*(folder / n for n in sorted(names) if n and Path(n).name == n), model_file]:
        with contextlib.suppress(OSError):
            if path.stat().st_mtime >= since - 1:
                path.unlink()
                removed.append(path)
    return removed


def quantize_static_onnx(src: str, dst: Path, params: StaticParams, calibration: Dataset | None,
                         calibration_cache: Path | None = None, *, percentile: float | None = None,
                         symmetric: bool | None = None) -> None:
    """ONNX Runtime's ``quantize_static`` with ``params``; ``percentile`` (Percentile calibration, default 99.99) and
    ``symmetric`` (activation ranges; default: symmetric for signed activations) are the calibration search's knobs."""
    if calibration is None:
        raise UserError("static quantization needs calibration data", fix="pass --data (its validation split is used)")
    extra = {"ActivationSymmetric": params.activation_type == "S8" if symmetric is None else symmetric}
    if params.calibrate_method == "Percentile":
        extra["CalibPercentile"] = percentile or 99.99
    # The Entropy/Percentile calibrators print progress to stdout; keep servopt's display clean.
    with contextlib.redirect_stdout(io.StringIO()):
        _quantize_static(src, dst, params, calibration, calibration_cache, extra)


def _quantize_static(src: str, dst: Path, params: StaticParams, calibration: Dataset, calibration_cache: Path | None,
                     extra: dict) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    quantize_static(
        src, str(dst), CalibrationReader(calibration, params.calibration_samples),
        quant_format=getattr(QuantFormat, params.quant_format),
        activation_type=getattr(QuantType, QTYPES[params.activation_type]),
        weight_type=getattr(QuantType, QTYPES[params.weight_type]),
        per_channel=params.per_channel, reduce_range=params.reduce_range,
        calibrate_method=getattr(CalibrationMethod, params.calibrate_method),
        nodes_to_exclude=params.nodes_to_exclude or None, extra_options=extra,
        **({"calibration_cache_path": str(calibration_cache)} if calibration_cache else {}),
    )


@register_pass
class OrtQuantizeStatic(Pass):
    """Static INT8 with calibration: QDQ or QOperator, chosen types, per-channel, MinMax/Entropy/Percentile."""

    name = "ort-quantize-static"
    input_format = "onnx"
    output_format = "onnx"
    Params = StaticParams
    int8_recipe = True

    @classmethod
    def int8_kernel(cls, params: StaticParams) -> Int8Kernel:
        return params.int8_kernel()

    @classmethod
    def describe(cls, params: StaticParams, report: dict | None = None) -> str:
        return f"plain {params.calibrate_method} calibration" + (", 7-bit weights" if params.reduce_range else "")

    def run(self, artifact: Artifact, params: StaticParams, out_dir: Path, ctx: BuildContext) -> PassOutput:
        src = preprocess_for_quantization(str(artifact.path), out_dir)
        quantize_static_onnx(src, out_dir / "model.onnx", params, ctx.calibration)
        Path(out_dir / "preprocessed.onnx").unlink(missing_ok=True)
        return PassOutput(format="onnx", file="model.onnx",
                          report={"calibration_samples": min(params.calibration_samples, len(ctx.calibration or []))})
