"""Variants as data, and the builders every family's catalogue is made of.

A variant is a pass chain + a runtime + its options: adding one is one entry in
its family's ``catalogue`` (or a new pass / runtime registered elsewhere). The
builders here are shared by the families (ONNX Runtime levels, static INT8 in
the format this CPU runs fast, OpenVINO, the GPU runtimes); a family composes
them and adds its own. Which variants run by default follows the CPU's features,
each one left out with its reason.

Variants name passes and runtimes by their registered names only: this layer
imports neither, so the server and the families stay light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from servopt.cpu import CpuFeatures
from servopt.machine import MALLOC_TUNED_ENV
from servopt.spec import ModelSpec

Role = Literal["original", "baseline", "original+baseline"] | None


@dataclass
class Variant:
    name: str
    group: str  # pytorch | onnxruntime | int8 | openvino | openvino-ep | fp16 | gpu | lab
    runtime: str
    chain: list[tuple[str, dict]] = field(default_factory=list)
    options: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    default: bool = True
    description: str = ""
    left_out_why: str = ""  # why it is not in the default sweep on this machine (shown in the report)
    gate: bool = True  # verified before timing; False: a baseline timed whatever its quality (never chosen if it fails)
    # The original (everything is verified against it) and the baseline (every same-run ratio is taken against it):
    # marked here, in the catalogue, so nothing else hard-codes their names.
    role: Role = None
    # A variant that only recovers quality another one lost (same kernels, another calibration or recovery pass):
    # a racing sweep does not build it when that one already meets every quality bound.
    refines: str | None = None
    # A refinement that runs the same kernels as the variant it refines (another calibration, NNCF's QDQ made unsigned):
    # once one recovers the quality, the others cannot be faster. False: it may run slower ones (float islands, U8U8).
    same_kernels: bool = True

    @property
    def is_original(self) -> bool:
        return self.role in ("original", "original+baseline")

    @property
    def is_baseline(self) -> bool:
        return self.role in ("baseline", "original+baseline")

    @property
    def left_out(self) -> str:
        return self.left_out_why or self.description


@dataclass(frozen=True)
class CatalogueContext:
    """What a catalogue is made from: the model (its spec, whether it is a torch source, whether dense layers dominate),
    the CPU's features, and the tightest quality tolerance among the targets."""

    spec: ModelSpec
    is_torch: bool
    linear_heavy: bool
    cpu: CpuFeatures
    accuracy_drop: float = 1.0
    # a CPU target names an instruction set without 8-bit dot products (cpu-server: an AVX2 EPYC): the INT8 weights
    # are built for it, in 7 bits, even where this CPU has VNNI (``int8_cpu``)
    deploy_without_vnni: bool = False
    # how a torch source is exported (``export.EXPORT_ORDER``): the family's ``exporter``, given by the caller (this
    # module cannot import the family registry: families.base imports it)
    exporter: str = "auto"

    @property
    def int8_cpu(self) -> CpuFeatures:
        """The CPU the INT8 weights are built for: this one, or — a target naming an ISA without VNNI — this one without
        its dot products (a model with 8-bit weights built here would compute wrong sums there)."""
        return self.cpu.without_dot_products() if self.deploy_without_vnni else self.cpu

    @property
    def export(self) -> list[tuple[str, dict]]:
        """The chain's first step: a torch source is exported to ONNX first; an ONNX source is used as given."""
        if not self.is_torch:
            return []
        # "auto" keeps the step's old parameters (and cache keys)
        return [("export-onnx", {} if self.exporter == "auto" else {"exporter": self.exporter})]


def when(condition: bool, why: str) -> dict:
    """``default`` and the reason it is off, for a variant that only pays on some CPUs."""
    return {"default": condition, "left_out_why": "" if condition else why}


def static(fmt: str, act: str, wt: str, method: str = "MinMax", per_channel: bool = True, samples: int = 100,
           reduce_range: bool = False) -> dict:
    """ONNX Runtime static INT8 parameters (``ort-quantize-static``)."""
    return {"quant_format": fmt, "activation_type": act, "weight_type": wt, "per_channel": per_channel,
            "calibrate_method": method, "calibration_samples": samples, "reduce_range": reduce_range}


def nncf_onnx(cpu: CpuFeatures, **params) -> tuple[str, dict]:
    """NNCF's post-training INT8 on the ONNX graph, in the INT8 format ONNX Runtime runs fast on ``cpu``: unsigned
    activations unless it has fast signed kernels, 7-bit weights where U8S8 saturates, full 8 bits where it cannot."""
    return ("nncf-quantize-onnx", {"activations": "signed" if cpu.int8_signed else "unsigned",
                                   "overflow_fix": "enable" if cpu.int8_saturates else "disable", **params})


def nncf_ov(cpu: CpuFeatures, **params) -> tuple[str, dict]:
    """NNCF's post-training INT8 for OpenVINO: every layer's weights in 7 bits where oneDNN's int16 pairs saturate
    (its own default halves the first layer's only: 0.82 points lost on an emulated AVX2 CPU for the demo)."""
    return ("nncf-quantize", {**({"overflow_fix": "enable"} if cpu.int8_saturates else {}), **params})


def dynamic_int8(cpu: CpuFeatures, **params) -> tuple[str, dict]:
    """ONNX Runtime dynamic INT8 (``ort-quantize-dynamic``) that this CPU computes as asked: s8 weights in 7 bits where
    its U8S8 kernel saturates (x86 without VNNI). With full 8-bit per-channel weights one pair in a hundred of
    all-mpnet-base-v2's could overflow there, and its embeddings came out unrelated to fp32's (mean cosine 0.0104 on
    a Zen 2; 0.89 with 7-bit weights or VNNI)."""
    s8 = params.get("weight_type", "S8") == "S8"
    return ("ort-quantize-dynamic", {**params, "reduce_range": True} if s8 and cpu.int8_saturates else params)


NO_SATURATION = ("this CPU has 8-bit dot products (VNNI): U8S8 cannot saturate here, so 7-bit weights or U8U8 kernels "
                 "would only cost precision or speed")
NO_BF16 = "this CPU has no bf16 arithmetic (AVX512-BF16 / AMX-BF16): bf16 would be emulated, slower than fp32"
NO_FP16 = "this CPU has no fp16 arithmetic (AVX512-FP16 / ARM fp16): it would be emulated or refused"
NO_S8S8 = ("ONNX Runtime runs S8S8 QOperator fast only with AVX-VNNI-INT8 (x86) or SDOT/SMMLA (ARM); measured 4x slower "
           "than U8S8 on AVX2 and about 10x slower on a Zen 4 with AVX512-VNNI")
NOT_LINEAR = "dynamic INT8 pays for Linear-heavy models (transformers); this one is convolution-heavy (10x slower measured)"
OWN_ENV = ("runs in an environment of its own (onnxruntime-openvino, about 500 MB, created on first use): "
           "opt in with --variants 'ortep-openvino-*'")
TUNED = MALLOC_TUNED_ENV
# The lab's exercises (graph levels below ORT_ENABLE_ALL, the text encoder's eval/no_grad ladder): they teach what each
# step does and never win a target, so the default sweep leaves them to --lab.
LAB = {"default": False, "left_out_why": "the lab's ladder: measured with --lab (or --variants lab)"}


def ort_reference(ctx: CatalogueContext, description: str) -> Variant:
    """ONNX Runtime with its defaults: the baseline of every same-run ratio, and the original of an ONNX source."""
    return Variant("ort-fp32", "onnxruntime", "onnxruntime", ctx.export, {"graph_optimization_level": "all"},
                   description=description, role="baseline" if ctx.is_torch else "original+baseline")


def ortep_openvino(ctx: CatalogueContext) -> list[Variant]:
    """ONNX Runtime's OpenVINO execution provider on the fp32 and the QDQ INT8 model, both hints: what the flexible
    hardware tutorial switches to by changing only the provider list (opt in: its own environment)."""
    qdq = [*ctx.export, ("ort-quantize-static", static("QDQ", "S8", "S8"))]
    return [Variant(f"ortep-openvino-{what}{suffix}", "openvino-ep", "onnxruntime-openvino", chain, {"hint": hint},
                    default=False, left_out_why=OWN_ENV,
                    description=f"ONNX Runtime + OpenVINO execution provider (CPU, FP32 precision), {what} model, {hint} hint")
            for what, chain in (("fp32", ctx.export), ("int8-qdq", qdq))
            for suffix, hint in (("", "LATENCY"), ("-throughput", "THROUGHPUT"))]


def openvino_float(ctx: CatalogueContext) -> list[Variant]:
    """OpenVINO fp32 (pinned: the plugin picks bf16 on its own on bf16 CPUs), bf16 and fp16 where the CPU computes them."""
    ir = [*ctx.export, ("openvino-convert", {})]
    out = []
    for precision, gate in (("fp32", when(True, "")), ("bf16", when(ctx.cpu.bf16, NO_BF16)), ("fp16", when(ctx.cpu.fp16, NO_FP16))):
        for hint in ("LATENCY", "THROUGHPUT"):
            pinned = " (pinned: the plugin would pick bf16 on its own on bf16 CPUs)" if precision == "fp32" else ""
            out.append(Variant(f"ov-{precision}-{hint.lower()}", "openvino", "openvino", ir, {"hint": hint, "precision": precision},
                               description=f"OpenVINO {precision} inference precision{pinned}, {hint} hint", **gate))
    return out


def gpu_variants(ctx: CatalogueContext) -> list[Variant]:
    """CUDA and TensorRT (ONNX Runtime), and PyTorch on CUDA: skipped with the reason where no GPU exists."""
    v = [Variant("ort-cuda-fp32", "gpu", "onnxruntime-cuda", ctx.export, description="ONNX Runtime CUDA execution provider"),
         Variant("ort-tensorrt-fp16", "gpu", "onnxruntime-cuda", ctx.export,
                 {"providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider"], "trt_fp16": True},
                 description="ONNX Runtime TensorRT execution provider, FP16")]
    if ctx.is_torch:
        v.append(Variant("torch-cuda-fp16", "gpu", "torch-cuda", options={"dtype": "fp16"}, description="PyTorch on CUDA in FP16"))
    return v


def asking_precision(variants: list[Variant]) -> list[Variant]:
    """ONNX Runtime variants of the INT8 and FP16 groups ask for that precision, so a run that computes another one
    (a quantizer that left every layer float, an FP16 graph cast back) fails verification instead of passing as fast."""
    for v in variants:
        if v.runtime.startswith("onnxruntime") and v.group in ("int8", "fp16") and "precision" not in v.options:
            v.options = {**v.options, "precision": v.group}
    return variants


def tensor_catalogue(ctx: CatalogueContext) -> list[Variant]:
    """Models with fixed-shape tensor inputs (image classifiers, generic embedding models): what a family gets unless it
    declares its own. PyTorch eager / channels_last / compile; ONNX Runtime graph levels, online and offline; static INT8
    in every format and the passes that recover accuracy; FP16; OpenVINO and NNCF; GPU runtimes."""
    cpu, export, drop = ctx.cpu, ctx.export, ctx.accuracy_drop
    v: list[Variant] = []
    if ctx.is_torch:
        v += [
            Variant("torch-eager", "pytorch", "torch", description="PyTorch eager under inference_mode (the original)", role="original"),
            Variant("torch-channels-last", "pytorch", "torch", options={"channels_last": True}, env=TUNED,
                    description="eager, channels_last memory format, glibc malloc tuned"),
            Variant("torch-compile", "pytorch", "torch", options={"compile": "default", "freezing": True, "channels_last": True},
                    env=TUNED, description="torch.compile (inductor, freezing), malloc tuned; compile time counts as cold start"),
            Variant("torch-compile-max-autotune", "pytorch", "torch",
                    options={"compile": "max-autotune-no-cudagraphs", "freezing": True, "channels_last": True}, env=TUNED,
                    default=False, left_out_why="minutes of autotuning for little gain on CPU: opt in",
                    description="torch.compile max-autotune-no-cudagraphs"),
            Variant("torch-int8-dynamic", "pytorch", "torch", chain=[("torch-quantize-dynamic", {})],
                    options={"quantize_dynamic": True}, description="torch dynamic INT8 of Linear layers",
                    **when(ctx.linear_heavy, NOT_LINEAR)),
            Variant("torch-bf16-autocast", "pytorch", "torch", options={"dtype": "bf16", "autocast": True, "channels_last": True},
                    env=TUNED, description="eager under torch.autocast(bf16): oneDNN bf16 kernels on CPUs with bf16",
                    **when(cpu.bf16, NO_BF16)),
            Variant("torch-compile-bf16", "pytorch", "torch",
                    options={"compile": "default", "freezing": True, "channels_last": True, "dtype": "bf16"}, env=TUNED,
                    description="torch.compile (inductor, freezing) of the module cast to bf16", **when(cpu.bf16, NO_BF16)),
        ]
    v += [
        ort_reference(ctx, "ONNX Runtime defaults (ORT_ENABLE_ALL): the reference every ratio is taken against"),
        Variant("ort-basic", "lab", "onnxruntime", export, {"graph_optimization_level": "basic"}, **LAB,
                description="online graph optimization, basic level"),
        Variant("ort-extended", "lab", "onnxruntime", export, {"graph_optimization_level": "extended"}, **LAB,
                description="online graph optimization, extended level"),
        Variant("ort-fp32-1thread", "onnxruntime", "onnxruntime", export, {"graph_optimization_level": "all", "intra_op_threads": 1},
                description="ORT_ENABLE_ALL with one intra-op thread (for packing several instances per machine)"),
    ]
    for level in ("basic", "extended", "all"):  # the levels below "all" teach what each does: the lab's
        v.append(Variant(f"ort-offline-{level}", "onnxruntime" if level == "all" else "lab", "onnxruntime",
                         [*export, ("ort-graph-offline", {"level": level})], {"graph_optimization_level": "disable"},
                         description=f"graph optimized offline at level {level}, loaded with optimizations disabled",
                         **({} if level == "all" else LAB)))
    u8s8 = "ort-int8-static-qop-u8s8"
    # OpenVINO's oneDNN shifts signed activations into its u8 × s8 product: where that saturates, its INT8 models
    # keep their weights in 7 bits (the demo's QDQ S8S8 model in OpenVINO: 70.1 % top-1 on AVX2 kernels, 97.3 % here)
    ov_qdq = ("ort-quantize-static", static("QDQ", "S8", "S8", reduce_range=ctx.int8_cpu.int8_saturates))
    seven = " (7-bit weights: no VNNI here or on a target)" if ctx.int8_cpu.int8_saturates else ""
    # the CPU the INT8 weights must compute right on: this one, or a target's without VNNI (``int8_cpu``): there the
    # recipes that cannot saturate (7-bit weights, U8U8 kernels) are built even on a VNNI machine
    sat = ctx.int8_cpu.int8_saturates
    v += [
        Variant("ort-int8-dynamic", "int8", "onnxruntime", [*export, dynamic_int8(ctx.int8_cpu)],
                description="ORT dynamic INT8 (weights ahead, activations at run time)", **when(ctx.linear_heavy, NOT_LINEAR)),
        Variant("ort-int8-static-qdq", "int8", "onnxruntime", [*export, ("ort-quantize-static", static("QDQ", "S8", "S8"))],
                description="static INT8, QDQ, S8S8, per-channel, MinMax"),
        Variant("ort-int8-static-qdq-u8s8", "int8", "onnxruntime", [*export, ("ort-quantize-static", static("QDQ", "U8", "S8"))],
                description="static INT8, QDQ, U8S8, per-channel, MinMax"),
        Variant(u8s8, "int8", "onnxruntime", [*export, ("ort-quantize-static", static("QOperator", "U8", "S8"))],
                description="static INT8, QOperator, U8S8, per-channel, MinMax"),
        Variant("ort-int8-static-qop-u8u8", "int8", "onnxruntime", [*export, ("ort-quantize-static", static("QOperator", "U8", "U8"))],
                description="static INT8, QOperator, U8 weights asked, per-channel, MinMax (ONNX Runtime writes per-channel "
                            "conv weights as s8 anyway: U8S8 kernels on convs)"),
        Variant("ort-int8-static-qop-s8s8", "int8", "onnxruntime", [*export, ("ort-quantize-static", static("QOperator", "S8", "S8"))],
                description="static INT8, QOperator, S8S8, per-channel, MinMax", **when(cpu.int8_signed, NO_S8S8)),
        # Without VNNI this ran faster than plain U8S8 on an AVX2 Zen 4 (Olive's search found it: 284 vs 251 img/s, same
        # run), and its 7-bit weights kept the accuracy plain calibration lost (a Zen 3: 0.54 points lost where U8S8 lost
        # 5.43): a first-round candidate there, not a refinement. ONNX Runtime (1.32) writes per-channel conv weights as
        # s8 even when asked for U8 (tests/test_int8_overflow.py): on a CNN its kernels are U8S8 with 7-bit weights.
        Variant("ort-int8-static-qop-u8u8-rr", "int8", "onnxruntime",
                [*export, ("ort-quantize-static", static("QOperator", "U8", "U8", reduce_range=True))],
                description="static INT8, QOperator, U8 weights asked (s8 on convs), 7-bit (reduce_range), per-channel, MinMax",
                **when(sat, NO_SATURATION)),
        # Refinements of the plain U8S8 model, cheapest first: a racing sweep builds them one by one, only while none
        # recovers the quality bounds, those that run the same INT8 kernels before those that may run slower ones.
        Variant("ort-int8-static-qop-u8s8-rr", "int8", "onnxruntime",
                [*export, ("ort-quantize-static", static("QOperator", "U8", "S8", reduce_range=True))],
                description="static INT8, QOperator U8S8 with 7-bit weights (reduce_range): no U8S8 saturation without VNNI",
                refines=u8s8, **when(sat, NO_SATURATION)),
        Variant("ort-int8-nncf", "int8", "onnxruntime", [*export, nncf_onnx(ctx.int8_cpu)], refines=u8s8,
                description="NNCF post-training INT8 on the ONNX graph (fast bias correction), QDQ run by ONNX Runtime"),
        Variant("ort-int8-cle-nncf", "int8", "onnxruntime", [*export, ("equalize", {}), nncf_onnx(ctx.int8_cpu)], refines=u8s8,
                description="cross-layer equalization of conv chains, then NNCF INT8 on the ONNX graph"),
        Variant("ort-int8-nncf-bc", "int8", "onnxruntime", [*export, nncf_onnx(ctx.int8_cpu, bias_correction="full")], refines=u8s8,
                description="NNCF post-training INT8 on the ONNX graph with full bias correction"),
        Variant("ort-int8-nncf-mixed", "int8", "onnxruntime", [*export, nncf_onnx(ctx.int8_cpu, preset="mixed")], refines=u8s8,
                description="NNCF post-training INT8 on the ONNX graph, mixed preset (asymmetric activations)"),
        Variant("ort-int8-entropy", "int8", "onnxruntime",
                [*export, ("ort-quantize-static", static("QOperator", "U8", "S8", "Entropy", samples=64))],
                description="static INT8, QOperator U8S8, Entropy calibration", refines=u8s8),
        Variant("ort-int8-percentile", "int8", "onnxruntime",
                [*export, ("ort-quantize-static", static("QOperator", "U8", "S8", "Percentile", samples=64))],
                description="static INT8, QOperator U8S8, Percentile (99.99) calibration", refines=u8s8),
        Variant("ort-int8-calibration-search", "int8", "onnxruntime",
                [*export, ("ort-quantize-calibration-search", {"max_drop": drop, "try_reduce_range": sat})],
                refines=u8s8,
                description=f"static U8S8 INT8, the calibration (method, percentile, symmetry, per-channel) that keeps the tuning "
                            f"split within {drop} point(s), fastest first (Olive's search space, ranked)"),
        Variant("ort-int8-static-qop-u8s8-x64precision", "int8", "onnxruntime",
                [*export, ("ort-quantize-static", static("QOperator", "U8", "S8"))], {"x64_quant_precision": True},
                description="static INT8 U8S8 run with ONNX Runtime's session.x64quantprecision (U8U8 kernels: no saturation)",
                refines=u8s8, same_kernels=False, **when(sat, NO_SATURATION)),
        Variant("ort-int8-accuracy-aware", "int8", "onnxruntime",
                [*export, ("ort-quantize-accuracy-aware", {**static("QOperator", "U8", "S8", reduce_range=sat),
                                                          "max_drop": drop})], refines=u8s8, same_kernels=False,
                description=f"as much INT8 (QOperator U8S8) as fits a {drop}-point drop; the fastest mix within it"),
        Variant("ort-fp16", "fp16", "onnxruntime", [*export, ("fp16", {})],
                description="FP16 weights, half the size" + ("" if cpu.fp16 else
                            "; this CPU has no fp16 arithmetic, so ONNX Runtime computes through casts (slower than fp32)")),
        *openvino_float(ctx),
        Variant("ov-int8-qdq", "openvino", "openvino", [*export, ov_qdq], {"hint": "LATENCY"},
                description=f"OpenVINO running ORT's QDQ INT8 model{seven}, LATENCY hint"),
        Variant("ov-int8-qdq-throughput", "openvino", "openvino", [*export, ov_qdq], {"hint": "THROUGHPUT"},
                description=f"OpenVINO running ORT's QDQ INT8 model{seven}, THROUGHPUT hint (parallel requests)"),
        *ortep_openvino(ctx),
        Variant("nncf-int8-latency", "openvino", "openvino", [*export, nncf_ov(ctx.int8_cpu)], {"hint": "LATENCY"},
                description=f"NNCF post-training INT8{seven}, OpenVINO LATENCY hint" + (" (AMX-INT8 tiles)" if cpu.amx else "")),
        Variant("nncf-int8-throughput", "openvino", "openvino", [*export, nncf_ov(ctx.int8_cpu)], {"hint": "THROUGHPUT"},
                description=f"NNCF post-training INT8{seven}, OpenVINO THROUGHPUT hint"),
        Variant("nncf-int8-accuracy-control", "openvino", "openvino",
                [*export, ("nncf-accuracy-control", {"max_drop": drop})], {"hint": "LATENCY"}, refines="nncf-int8-latency",
                description=f"nncf.quantize_with_accuracy_control, max drop {drop} point(s)"),
        *gpu_variants(ctx),
    ]
    return asking_precision(v)
