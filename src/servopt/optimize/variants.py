"""The catalogue of variants ``servopt optimize`` builds: a pass chain + a runtime + its options.

A variant is data, not code: adding one is one entry here (or a new pass /
runtime registered elsewhere). ``default=False`` entries run only when named
with ``--variants`` or included with ``--include-all``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import asdict, dataclass, field

from servopt.errors import UserError
from servopt.machine import CpuFeatures
from servopt.models.sources import LoadedModel
from servopt.runtimes.torch_runtime import MALLOC_TUNED_ENV


@dataclass
class Variant:
    name: str
    group: str  # pytorch | onnxruntime | int8 | openvino | fp16 | gpu
    runtime: str
    chain: list[tuple[str, dict]] = field(default_factory=list)
    options: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    default: bool = True
    description: str = ""
    needs_gpu: bool = False
    left_out_why: str = ""  # why it is not in the default sweep on this machine (shown in the report)
    gate: bool = True  # verified before timing; False: a baseline timed whatever its quality (never chosen if it fails)

    def key(self, source_hash: str, protocol: dict, data_hash: str) -> str:
        """Identity of a measurement: same key → same result, so a rerun skips it. Pass parameters enter with
        their defaults filled in, so a changed default invalidates the old measurement."""
        from servopt.passes.base import validate_params

        chain = [(name, validate_params(name, params).model_dump()) for name, params in self.chain]
        identity = {k: v for k, v in asdict(self).items() if k not in ("default", "description", "left_out_why", "gate")}
        body = json.dumps([{**identity, "chain": chain}, source_hash, protocol, data_hash], sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:16]


def _static(fmt: str, act: str, wt: str, method: str = "MinMax", per_channel: bool = True, samples: int = 100,
            reduce_range: bool = False) -> dict:
    return {"quant_format": fmt, "activation_type": act, "weight_type": wt, "per_channel": per_channel,
            "calibrate_method": method, "calibration_samples": samples, "reduce_range": reduce_range}


def nncf_onnx(cpu: CpuFeatures, **params) -> tuple[str, dict]:
    """NNCF's post-training INT8 on the ONNX graph, in the INT8 format ONNX Runtime runs fast on ``cpu``: unsigned
    activations unless it has fast signed kernels, 7-bit weights where U8S8 saturates, full 8 bits where it cannot."""
    return ("nncf-quantize-onnx", {"activations": "signed" if cpu.int8_signed else "unsigned",
                                   "overflow_fix": "enable" if cpu.int8_saturates else "disable", **params})


NO_SATURATION = ("this CPU has 8-bit dot products (VNNI): U8S8 cannot saturate here, so 7-bit weights or U8U8 kernels "
                 "would only cost precision or speed")


OWN_ENV = ("runs in an environment of its own (onnxruntime-openvino, about 500 MB, created on first use): "
           "opt in with --variants 'ortep-openvino-*'")


def ortep_openvino(export: list[tuple[str, dict]]) -> list[Variant]:
    """ONNX Runtime's OpenVINO execution provider on the fp32 and the QDQ INT8 model, both hints: what the flexible
    hardware tutorial switches to by changing only the provider list (opt in: its own environment)."""
    qdq = [*export, ("ort-quantize-static", _static("QDQ", "S8", "S8"))]
    return [Variant(f"ortep-openvino-{what}{suffix}", "openvino-ep", "onnxruntime-openvino", chain, {"hint": hint},
                    default=False, left_out_why=OWN_ENV,
                    description=f"ONNX Runtime + OpenVINO execution provider (CPU, FP32 precision), {what} model, {hint} hint")
            for what, chain in (("fp32", export), ("int8-qdq", qdq))
            for suffix, hint in (("", "LATENCY"), ("-throughput", "THROUGHPUT"))]


def _when(condition: bool, why: str) -> dict:
    """``default`` and the reason it is off, for a variant that only pays on some CPUs."""
    return {"default": condition, "left_out_why": "" if condition else why}


NO_BF16 = "this CPU has no bf16 arithmetic (AVX512-BF16 / AMX-BF16): bf16 would be emulated, slower than fp32"
NO_FP16 = "this CPU has no fp16 arithmetic (AVX512-FP16 / ARM fp16): it would be emulated or refused"


def catalogue(model: LoadedModel, *, linear_heavy: bool, accuracy_drop: float = 1.0, cpu: CpuFeatures | None = None) -> list[Variant]:
    """Every variant servopt knows for this model (torch ones only for torch sources). Which run by default follows
    the CPU's features (``cpu``: bf16, fp16 and 8-bit dot-product arithmetic), each exclusion with its reason."""
    cpu = cpu or CpuFeatures(frozenset())
    if model.spec.family_name == "text-embedding":
        return text_catalogue(model, accuracy_drop=accuracy_drop, cpu=cpu)
    export = [("export-onnx", {})] if model.is_torch else []
    no_bf16, no_fp16 = NO_BF16, NO_FP16
    no_s8s8 = ("ONNX Runtime runs S8S8 QOperator fast only with AVX-VNNI-INT8 (x86) or SDOT/SMMLA (ARM); measured 4x slower "
               "than U8S8 on AVX2 and 14x slower on a Zen 4 with AVX512-VNNI")
    not_linear = "dynamic INT8 pays for Linear-heavy models (transformers); this one is convolution-heavy (10x slower measured)"
    v: list[Variant] = []
    if model.is_torch:
        v += [
            Variant("torch-eager", "pytorch", "torch", description="PyTorch eager under inference_mode (the original)"),
            Variant("torch-channels-last", "pytorch", "torch", options={"channels_last": True}, env=MALLOC_TUNED_ENV,
                    description="eager, channels_last memory format, glibc malloc tuned"),
            Variant("torch-compile", "pytorch", "torch", options={"compile": "default", "freezing": True, "channels_last": True},
                    env=MALLOC_TUNED_ENV, description="torch.compile (inductor, freezing), malloc tuned; compile time counts as cold start"),
            Variant("torch-compile-max-autotune", "pytorch", "torch",
                    options={"compile": "max-autotune-no-cudagraphs", "freezing": True, "channels_last": True}, env=MALLOC_TUNED_ENV,
                    default=False, left_out_why="minutes of autotuning for little gain on CPU: opt in",
                    description="torch.compile max-autotune-no-cudagraphs"),
            Variant("torch-int8-dynamic", "pytorch", "torch", chain=[("torch-quantize-dynamic", {})],
                    options={"quantize_dynamic": True}, description="torch dynamic INT8 of Linear layers",
                    **_when(linear_heavy, not_linear)),
            Variant("torch-bf16-autocast", "pytorch", "torch", options={"dtype": "bf16", "autocast": True, "channels_last": True},
                    env=MALLOC_TUNED_ENV, description="eager under torch.autocast(bf16): oneDNN bf16 kernels on CPUs with bf16",
                    **_when(cpu.bf16, no_bf16)),
            Variant("torch-compile-bf16", "pytorch", "torch",
                    options={"compile": "default", "freezing": True, "channels_last": True, "dtype": "bf16"}, env=MALLOC_TUNED_ENV,
                    description="torch.compile (inductor, freezing) of the module cast to bf16", **_when(cpu.bf16, no_bf16)),
        ]
    v += [
        Variant("ort-fp32", "onnxruntime", "onnxruntime", export, {"graph_optimization_level": "all"},
                description="ONNX Runtime defaults (ORT_ENABLE_ALL): the reference every ratio is taken against"),
        Variant("ort-basic", "onnxruntime", "onnxruntime", export, {"graph_optimization_level": "basic"},
                description="online graph optimization, basic level"),
        Variant("ort-extended", "onnxruntime", "onnxruntime", export, {"graph_optimization_level": "extended"},
                description="online graph optimization, extended level"),
        Variant("ort-fp32-1thread", "onnxruntime", "onnxruntime", export, {"graph_optimization_level": "all", "intra_op_threads": 1},
                description="ORT_ENABLE_ALL with one intra-op thread (for packing several instances per machine)"),
    ]
    for level in ("basic", "extended", "all"):
        v.append(Variant(f"ort-offline-{level}", "onnxruntime", "onnxruntime", [*export, ("ort-graph-offline", {"level": level})],
                         {"graph_optimization_level": "disable"},
                         description=f"graph optimized offline at level {level}, loaded with optimizations disabled"))
    v += [
        Variant("ort-int8-dynamic", "int8", "onnxruntime", [*export, ("ort-quantize-dynamic", {})],
                description="ORT dynamic INT8 (weights ahead, activations at run time)", **_when(linear_heavy, not_linear)),
        Variant("ort-int8-static-qdq", "int8", "onnxruntime", [*export, ("ort-quantize-static", _static("QDQ", "S8", "S8"))],
                description="static INT8, QDQ, S8S8, per-channel, MinMax"),
        Variant("ort-int8-static-qdq-u8s8", "int8", "onnxruntime", [*export, ("ort-quantize-static", _static("QDQ", "U8", "S8"))],
                description="static INT8, QDQ, U8S8, per-channel, MinMax"),
        Variant("ort-int8-static-qop-u8s8", "int8", "onnxruntime", [*export, ("ort-quantize-static", _static("QOperator", "U8", "S8"))],
                description="static INT8, QOperator, U8S8, per-channel, MinMax"),
        Variant("ort-int8-static-qop-u8u8", "int8", "onnxruntime", [*export, ("ort-quantize-static", _static("QOperator", "U8", "U8"))],
                description="static INT8, QOperator, U8U8, per-channel, MinMax"),
        Variant("ort-int8-static-qop-s8s8", "int8", "onnxruntime", [*export, ("ort-quantize-static", _static("QOperator", "S8", "S8"))],
                description="static INT8, QOperator, S8S8, per-channel, MinMax", **_when(cpu.int8_signed, no_s8s8)),
        Variant("ort-int8-entropy", "int8", "onnxruntime",
                [*export, ("ort-quantize-static", _static("QOperator", "U8", "S8", "Entropy", samples=64))],
                description="static INT8, QOperator U8S8, Entropy calibration"),
        Variant("ort-int8-percentile", "int8", "onnxruntime",
                [*export, ("ort-quantize-static", _static("QOperator", "U8", "S8", "Percentile", samples=64))],
                description="static INT8, QOperator U8S8, Percentile (99.99) calibration"),
        Variant("ort-int8-static-qop-u8s8-rr", "int8", "onnxruntime",
                [*export, ("ort-quantize-static", _static("QOperator", "U8", "S8", reduce_range=True))],
                description="static INT8, QOperator U8S8 with 7-bit weights (reduce_range): no U8S8 saturation without VNNI",
                **_when(cpu.int8_saturates, NO_SATURATION)),
        Variant("ort-int8-static-qop-u8s8-x64precision", "int8", "onnxruntime",
                [*export, ("ort-quantize-static", _static("QOperator", "U8", "S8"))], {"x64_quant_precision": True},
                description="static INT8 U8S8 run with ONNX Runtime's session.x64quantprecision (U8U8 kernels: no saturation)",
                **_when(cpu.int8_saturates, NO_SATURATION)),
        Variant("ort-int8-nncf", "int8", "onnxruntime", [*export, nncf_onnx(cpu)],
                description="NNCF post-training INT8 on the ONNX graph (fast bias correction), QDQ run by ONNX Runtime"),
        Variant("ort-int8-nncf-bc", "int8", "onnxruntime", [*export, nncf_onnx(cpu, bias_correction="full")],
                description="NNCF post-training INT8 on the ONNX graph with full bias correction"),
        Variant("ort-int8-nncf-mixed", "int8", "onnxruntime", [*export, nncf_onnx(cpu, preset="mixed")],
                description="NNCF post-training INT8 on the ONNX graph, mixed preset (asymmetric activations)"),
        Variant("ort-int8-cle-nncf", "int8", "onnxruntime", [*export, ("equalize", {}), nncf_onnx(cpu)],
                description="cross-layer equalization of conv chains, then NNCF INT8 on the ONNX graph"),
        Variant("ort-int8-calibration-search", "int8", "onnxruntime",
                [*export, ("ort-quantize-calibration-search", {"max_drop": accuracy_drop, "try_reduce_range": cpu.int8_saturates})],
                description=f"static U8S8 INT8, the calibration (method, percentile, symmetry, per-channel) that keeps the tuning "
                            f"split within {accuracy_drop} point(s), fastest first (Olive's search space, ranked)"),
        Variant("ort-int8-accuracy-aware", "int8", "onnxruntime",
                [*export, ("ort-quantize-accuracy-aware", {**_static("QOperator", "U8", "S8", reduce_range=cpu.int8_saturates),
                                                          "max_drop": accuracy_drop})],
                description=f"as much INT8 (QOperator U8S8) as fits a {accuracy_drop}-point drop; the fastest mix within it"),
        Variant("ort-fp16", "fp16", "onnxruntime", [*export, ("fp16", {})],
                description="FP16 weights, half the size" + ("" if cpu.fp16 else
                            "; this CPU has no fp16 arithmetic, so ONNX Runtime computes through casts (slower than fp32)")),
        Variant("ov-fp32-latency", "openvino", "openvino", [*export, ("openvino-convert", {})], {"hint": "LATENCY", "precision": "fp32"},
                description="OpenVINO fp32 (pinned: the plugin would pick bf16 on its own on bf16 CPUs), LATENCY hint"),
        Variant("ov-fp32-throughput", "openvino", "openvino", [*export, ("openvino-convert", {})],
                {"hint": "THROUGHPUT", "precision": "fp32"}, description="OpenVINO fp32 (pinned), THROUGHPUT hint"),
        Variant("ov-bf16-latency", "openvino", "openvino", [*export, ("openvino-convert", {})], {"hint": "LATENCY", "precision": "bf16"},
                description="OpenVINO bf16 inference precision, LATENCY hint", **_when(cpu.bf16, no_bf16)),
        Variant("ov-bf16-throughput", "openvino", "openvino", [*export, ("openvino-convert", {})],
                {"hint": "THROUGHPUT", "precision": "bf16"}, description="OpenVINO bf16 inference precision, THROUGHPUT hint",
                **_when(cpu.bf16, no_bf16)),
        Variant("ov-fp16-latency", "openvino", "openvino", [*export, ("openvino-convert", {})], {"hint": "LATENCY", "precision": "fp16"},
                description="OpenVINO fp16 inference precision, LATENCY hint", **_when(cpu.fp16, no_fp16)),
        Variant("ov-int8-qdq", "openvino", "openvino", [*export, ("ort-quantize-static", _static("QDQ", "S8", "S8"))],
                {"hint": "LATENCY"}, description="OpenVINO running ORT's QDQ INT8 model, LATENCY hint"),
        Variant("ov-int8-qdq-throughput", "openvino", "openvino", [*export, ("ort-quantize-static", _static("QDQ", "S8", "S8"))],
                {"hint": "THROUGHPUT"}, description="OpenVINO running ORT's QDQ INT8 model, THROUGHPUT hint (parallel requests)"),
        *ortep_openvino(export),
        Variant("nncf-int8-latency", "openvino", "openvino", [*export, ("nncf-quantize", {})], {"hint": "LATENCY"},
                description="NNCF post-training INT8 (defaults), OpenVINO LATENCY hint" + (" (AMX-INT8 tiles)" if cpu.amx else "")),
        Variant("nncf-int8-throughput", "openvino", "openvino", [*export, ("nncf-quantize", {})], {"hint": "THROUGHPUT"},
                description="NNCF post-training INT8 (defaults), OpenVINO THROUGHPUT hint"),
        Variant("nncf-int8-accuracy-control", "openvino", "openvino",
                [*export, ("nncf-accuracy-control", {"max_drop": accuracy_drop})], {"hint": "LATENCY"},
                description=f"nncf.quantize_with_accuracy_control, max drop {accuracy_drop} point(s)"),
        Variant("ort-cuda-fp32", "gpu", "onnxruntime-cuda", export, needs_gpu=True,
                description="ONNX Runtime CUDA execution provider"),
        Variant("ort-tensorrt-fp16", "gpu", "onnxruntime-cuda", export,
                {"providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider"]}, needs_gpu=True,
                description="ONNX Runtime TensorRT execution provider, FP16"),
    ]
    if model.is_torch:
        v.append(Variant("torch-cuda-fp16", "gpu", "torch-cuda", options={"dtype": "fp16"}, needs_gpu=True,
                         description="PyTorch on CUDA in FP16"))
    return v


def text_catalogue(model: LoadedModel, *, accuracy_drop: float, cpu: CpuFeatures) -> list[Variant]:
    """Sentence encoders: what the lab compares (eval / no_grad / inference_mode, torch.compile modes, dynamic INT8,
    bf16/fp16 autocast, ONNX export with dynamic batch and sequence, ORT online vs offline and its transformer
    optimizer, dynamic and static INT8, OpenVINO fp32/bf16/INT8), for any encoder; judged by the embeddings."""
    export = [("export-onnx", {})] if model.is_torch else []
    # ONNX Runtime's transformer optimizer recognises attention in the TorchScript exporter's graph of eager
    # attention (the dynamo graph fuses only BiasGelu): that chain exports that way.
    fusable = [("export-onnx", {"exporter": "torchscript", "attention": "eager"})] if model.is_torch else []
    fused = [*fusable, ("ort-transformers-optimize", {})]
    dyn = "ort-quantize-dynamic"
    act = "S8" if cpu.int8_signed else "U8"  # ONNX Runtime's fast static INT8 on this CPU (see CpuFeatures.int8_signed)
    v: list[Variant] = []
    if model.is_torch:
        v += [
            Variant("torch-eager", "pytorch", "torch", description="PyTorch eval() + inference_mode (the original)"),
            Variant("torch-plain", "pytorch", "torch", options={"grad_mode": "plain"}, gate=False,
                    description="the module as a notebook calls it: training mode (dropout on), autograd on; measured as the "
                                "baseline, never chosen (dropout changes its embeddings)"),
            Variant("torch-eval", "pytorch", "torch", options={"grad_mode": "eval"}, description="eval(), autograd on"),
            Variant("torch-no-grad", "pytorch", "torch", options={"grad_mode": "no_grad"}, description="eval() + no_grad"),
            Variant("torch-compile", "pytorch", "torch", options={"compile": "default", "compile_dynamic": True}, env=MALLOC_TUNED_ENV,
                    description="torch.compile, dynamic shapes (no recompile per length); compile time counts as cold start"),
            Variant("torch-compile-max-autotune", "pytorch", "torch", options={"compile": "max-autotune", "compile_dynamic": True},
                    env=MALLOC_TUNED_ENV, default=False, left_out_why="minutes of autotuning: opt in",
                    description="torch.compile max-autotune, dynamic shapes"),
            Variant("torch-compile-max-autotune-no-cudagraphs", "pytorch", "torch",
                    options={"compile": "max-autotune-no-cudagraphs", "compile_dynamic": True}, env=MALLOC_TUNED_ENV, default=False,
                    left_out_why="minutes of autotuning: opt in", description="torch.compile max-autotune-no-cudagraphs"),
            Variant("torch-int8-dynamic", "pytorch", "torch", chain=[("torch-quantize-dynamic", {})], options={"quantize_dynamic": True},
                    description="torch.ao dynamic INT8 of nn.Linear (state_dict size on disk measured)"),
            Variant("torch-bf16-autocast", "pytorch", "torch", options={"dtype": "bf16", "autocast": True},
                    description="torch.autocast(bf16) over fp32 weights", **_when(cpu.bf16, NO_BF16)),
            Variant("torch-fp16-autocast", "pytorch", "torch", options={"dtype": "fp16", "autocast": True},
                    description="torch.autocast(fp16) over fp32 weights", **_when(cpu.fp16, NO_FP16)),
        ]
    v += [
        Variant("ort-fp32", "onnxruntime", "onnxruntime", export, {"graph_optimization_level": "all"},
                description="ONNX Runtime defaults, graph optimized online at load (the reference every ratio is taken against)"),
        Variant("ort-offline-all", "onnxruntime", "onnxruntime", [*export, ("ort-graph-offline", {"level": "all"})],
                {"graph_optimization_level": "disable"}, description="graph optimized offline, loaded with optimizations off (faster cold start)"),
        Variant("ort-transformers", "onnxruntime", "onnxruntime", fused,
                description="ONNX Runtime's transformer optimizer: attention, LayerNorm, GELU fusions (which applied: build report)"),
        Variant("ort-int8-dynamic", "int8", "onnxruntime", [*export, (dyn, {})], description="ORT dynamic INT8, S8 weights per tensor"),
        Variant("ort-int8-dynamic-per-channel", "int8", "onnxruntime", [*export, (dyn, {"per_channel": True})],
                description="ORT dynamic INT8, S8 weights per channel"),
        Variant("ort-int8-dynamic-u8", "int8", "onnxruntime", [*export, (dyn, {"weight_type": "U8"})],
                description="ORT dynamic INT8, U8 weights"),
        Variant("ort-transformers-int8-dynamic", "int8", "onnxruntime", [*fused, (dyn, {"per_channel": True})],
                description="transformer-optimized graph, then dynamic INT8 (S8 weights per channel)"),
        Variant("ort-int8-static-qdq", "int8", "onnxruntime", [*export, ("ort-quantize-static", _static("QDQ", act, "S8"))],
                description=f"static INT8 QDQ {act}S8 per channel, calibrated on the tuning texts", **_when(cpu.int8_dot,
                "static INT8 of activations needs 8-bit dot products (VNNI) to pay on transformers")),
        Variant("ort-int8-dynamic-per-channel-rr", "int8", "onnxruntime", [*export, (dyn, {"per_channel": True, "reduce_range": True})],
                description="ORT dynamic INT8, S8 weights per channel in 7 bits (reduce_range): no U8S8 saturation without VNNI",
                **_when(cpu.int8_saturates, NO_SATURATION)),
        Variant("ort-int8-nncf", "int8", "onnxruntime", [*export, nncf_onnx(cpu, model_type="transformer", preset="mixed")],
                description="NNCF post-training INT8 on the ONNX graph, transformer rules (SmoothQuant), QDQ run by ONNX Runtime",
                **_when(cpu.int8_dot, "static INT8 of activations needs 8-bit dot products (VNNI) to pay on transformers")),
        Variant("ort-int8-accuracy-aware", "int8", "onnxruntime",
                [*fused, ("ort-quantize-accuracy-aware", {"mode": "dynamic", "per_channel": True, "max_drop": accuracy_drop,
                                                          "reduce_range": cpu.int8_saturates})],
                description=f"as much dynamic INT8 as keeps mean cosine within {accuracy_drop / 100:.3g} of the original; the fastest mix"),
        Variant("ort-fp16", "fp16", "onnxruntime", [*export, ("fp16", {})],
                description="FP16 weights, half the size" + ("" if cpu.fp16 else "; no fp16 arithmetic here: computed through casts")),
        Variant("ov-fp32-latency", "openvino", "openvino", [*export, ("openvino-convert", {})], {"hint": "LATENCY", "precision": "fp32"},
                description="OpenVINO fp32 (pinned), LATENCY hint"),
        Variant("ov-fp32-throughput", "openvino", "openvino", [*export, ("openvino-convert", {})],
                {"hint": "THROUGHPUT", "precision": "fp32"}, description="OpenVINO fp32 (pinned), THROUGHPUT hint"),
        Variant("ov-bf16-latency", "openvino", "openvino", [*export, ("openvino-convert", {})], {"hint": "LATENCY", "precision": "bf16"},
                description="OpenVINO bf16, LATENCY hint", **_when(cpu.bf16, NO_BF16)),
        Variant("ov-bf16-throughput", "openvino", "openvino", [*export, ("openvino-convert", {})],
                {"hint": "THROUGHPUT", "precision": "bf16"}, description="OpenVINO bf16, THROUGHPUT hint", **_when(cpu.bf16, NO_BF16)),
        *ortep_openvino(export),
        Variant("nncf-int8-latency", "openvino", "openvino", [*export, ("nncf-quantize", {"model_type": "transformer"})],
                {"hint": "LATENCY"}, description="NNCF INT8 with the transformer model type, OpenVINO LATENCY hint"),
        Variant("nncf-int8-throughput", "openvino", "openvino", [*export, ("nncf-quantize", {"model_type": "transformer"})],
                {"hint": "THROUGHPUT"}, description="NNCF INT8 with the transformer model type, OpenVINO THROUGHPUT hint"),
        Variant("ort-cuda-fp32", "gpu", "onnxruntime-cuda", export, needs_gpu=True, description="ONNX Runtime CUDA execution provider"),
        Variant("ort-tensorrt-fp16", "gpu", "onnxruntime-cuda", export,
                {"providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider"]}, needs_gpu=True,
                description="ONNX Runtime TensorRT execution provider, FP16"),
    ]
    if model.is_torch:
        v.append(Variant("torch-cuda-fp16", "gpu", "torch-cuda", options={"dtype": "fp16"}, needs_gpu=True, description="PyTorch on CUDA in FP16"))
    return v


def left_out_reason(v: Variant) -> str:
    return v.left_out_why or v.description


def select(variants: list[Variant], patterns: list[str] | None, include_all: bool) -> list[Variant]:
    """Default variants, or those matching ``--variants`` names/globs/groups."""
    if not patterns:
        return [v for v in variants if v.default or include_all]
    chosen = [v for v in variants if any(fnmatch.fnmatch(v.name, p) or v.group == p for p in patterns)]
    unknown = [p for p in patterns if not any(fnmatch.fnmatch(v.name, p) or v.group == p for v in variants)]
    if unknown:
        raise UserError(f"no variant matches {', '.join(unknown)}", fix=f"known variants: {', '.join(v.name for v in variants)}")
    return chosen


def is_linear_heavy(onnx_path: str | None) -> bool:
    """True when MatMul/Gemm dominate the graph (transformers): dynamic INT8 then pays off."""
    if onnx_path is None:
        return False
    import onnx

    ops = [n.op_type for n in onnx.load(onnx_path, load_external_data=False).graph.node]
    dense, conv = sum(o in ("MatMul", "Gemm") for o in ops), sum(o.startswith("Conv") for o in ops)
    return dense > conv
