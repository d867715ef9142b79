"""ONNX Runtime (CPU, and CUDA/TensorRT providers where a GPU exists)."""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from servopt.contracts import Artifact, OpProfile, SessionInfo
from servopt.cpu import CpuFeatures, Int8Kernel
from servopt.errors import UserError
from servopt.machine import Device, gpu_present, host_features
from servopt.runtimes.base import Runtime, RuntimeOptions, Session, register_runtime, top_ops

GRAPH_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
CPU = "CPUExecutionProvider"
# Fusions whose CPU kernels run slower than the operators they replace, so the CPU provider does not make them. Keys:
# ONNX Runtime's graph-optimizer names (``disabled_optimizers``); values: the transformer optimizer's FusionOptions flag
# that makes the same operator offline. SkipLayerNormalization's CPU kernel is a scalar loop with a division per
# element (contrib_ops/cpu/skip_layer_norm.cc), where Add + LayerNormalization run vectorized: 0.30 vs 0.07 ms on a
# [1, 128, 384] tensor. all-MiniLM-L6-v2's fused dynamic INT8 without both: 0.89-0.91x the model call's time at one
# thread (sentences, batches of 32, 128 tokens), 0.90-0.97x at two (within the noise), the same embeddings (mean cosine
# to fp32 0.99244 vs 0.99246): ORT 1.32, AMD EPYC AVX2, benchmarks/cpu_fusions.py (docs/benchmarks.md).
CPU_SLOW_FUSIONS = {"SkipLayerNormFusion": "enable_skip_layer_norm", "BiasGeluFusion": "enable_bias_gelu"}


class OrtOptions(RuntimeOptions):
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    # Idle intra-op threads spin-wait by default; in a server they would steal the cores the event loop needs.
    allow_spinning: bool = True
    # How long an idle intra-op thread spins before it sleeps (``session.intra_op.spin_duration_us``, ONNX Runtime
    # 1.26+); None: ORT's own spin count (servers: no spinning, see ``serving_options``).
    spin_duration_us: int | None = Field(default=None, ge=1)
    providers: list[str] | None = None
    optimized_model_filepath: str | None = None  # write the optimized graph (the offline-optimization pass)
    # x86 without VNNI: U8U8 kernels instead of U8S8 ones, which saturate there (``CpuFeatures.int8_saturates``).
    x64_quant_precision: bool = False
    # TensorRT's FP16 kernels (its provider option ``trt_fp16_enable``); read back from the session that ran.
    trt_fp16: bool = False
    # TensorRT's INT8 kernels (``trt_int8_enable``) for a calibrated QDQ graph (explicit quantization); read back likewise.
    trt_int8: bool = False
    # The precision the variant means to run (None: whatever the graph holds). Checked against what ran: an fp16 or
    # INT8 variant whose graph or provider runs something else fails verification instead of being timed as one.
    precision: Literal["fp32", "fp16", "bf16", "int8"] | None = None
    # Make the fusions ``CPU_SLOW_FUSIONS`` names on the CPU provider too (to measure what they cost).
    cpu_slow_fusions: bool = False


def disabled_fusions(options: OrtOptions, provider: str) -> list[str]:
    """The graph optimizers a session on ``provider`` runs without (see ``CPU_SLOW_FUSIONS``)."""
    return [] if options.cpu_slow_fusions or provider != CPU else list(CPU_SLOW_FUSIONS)


def spinning(options: OrtOptions) -> str:
    """What a session's idle intra-op threads do, as its options set it (for what ran)."""
    if not options.allow_spinning:
        return "off"
    return f"{options.spin_duration_us} us" if options.spin_duration_us is not None else "ORT default"


def session_options(options: OrtOptions, profile_prefix: str | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, GRAPH_LEVELS[options.graph_optimization_level])
    if options.intra_op_threads:
        so.intra_op_num_threads = int(options.intra_op_threads)
    if options.inter_op_threads:
        so.inter_op_num_threads = int(options.inter_op_threads)
    if not options.allow_spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif options.spin_duration_us is not None:
        so.add_session_config_entry("session.intra_op.spin_duration_us", str(int(options.spin_duration_us)))
    if options.x64_quant_precision:
        so.add_session_config_entry("session.x64quantprecision", "1")
    if options.optimized_model_filepath:
        so.optimized_model_filepath = str(options.optimized_model_filepath)
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    so.log_severity_level = 3
    return so


TRT = "TensorrtExecutionProvider"
READBACK_RUNS = 2  # profiled calls behind a session's read-back of the kernels that ran (the first one included)
_DYNAMIC_INT8 = {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
                 "QAttention", "DynamicQuantizeLSTM"}


def graph_precision(path: str) -> str:
    """The precision the graph itself runs in, from its operators: ONNX Runtime has no other record of it. INT8 says its
    format: QOperator (QLinear* / QGemm kernels), dynamic (activations quantized at run time) or QDQ (Q/DQ pairs that
    the CPU provider fuses into INT8 kernels)."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    if ops & _DYNAMIC_INT8:
        return "int8 (dynamic)"
    if any(op.startswith("QLinear") for op in ops) or "QGemm" in ops:
        return "int8 (QOperator)"
    if "QuantizeLinear" in ops and "DequantizeLinear" in ops:
        return "int8 (QDQ)"
    float16 = onnx.TensorProto.FLOAT16
    if any(i.data_type == float16 for i in model.graph.initializer) or any(
            i.type.tensor_type.elem_type == float16 for i in model.graph.input):
        return "fp16"
    return "fp32"


def provider_options(provider: str, options: OrtOptions) -> dict[str, str | int | bool]:
    """The options a provider is opened with (ONNX Runtime takes them per provider)."""
    if provider != TRT:
        return {}
    return {k: True for k, on in (("trt_fp16_enable", options.trt_fp16), ("trt_int8_enable", options.trt_int8)) if on}


def precision_ran(graph: str, provider: str, ran_options: dict[str, str]) -> str:
    """What a session computes in: the graph's precision, unless the provider that ran lowers it (TensorRT in FP16)."""
    def on(option: str) -> bool:
        return provider == TRT and str(ran_options.get(option, "0")).lower() in ("1", "true")

    if on("trt_int8_enable") and graph.startswith("int8 ("):
        return f"int8 (TensorRT, {graph[len('int8 ('):-1]})"
    if on("trt_fp16_enable") and graph == "fp32":
        return "fp16 (TensorRT)"
    return graph


# The operators that carry a model's arithmetic (convolutions, matrix products, attention). Integer kernels are the
# INT8 forms ONNX Runtime runs: a QDQ graph only runs INT8 where the provider fused DQ → op → Q into one of these.
INT8_KERNELS = frozenset({"QLinearConv", "QLinearMatMul", "QGemm", "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul",
                          "MatMulIntegerToFloat", "QAttention", "QLinearConvTranspose", "DynamicQuantizeLSTM"})
FLOAT_KERNELS = frozenset({"Conv", "ConvTranspose", "FusedConv", "NhwcFusedConv", "NhwcConv", "MatMul", "FusedMatMul",
                           "TransposeMatMul", "Gemm", "FusedGemm", "Attention", "MultiHeadAttention", "GroupQueryAttention",
                           "LSTM", "GRU"})
_FLOAT_TYPES = {"float": "fp32", "float16": "fp16", "bfloat16": "bf16", "double": "fp64"}


def kernels_ran(events: list[dict], runs: int) -> dict[str, dict[str, float]]:
    """The heavy operators of a profiled run grouped by the precision their kernel computed in (integer kernels: int8;
    the others: their first input's element type, so an fp16 graph that the provider cast back to float reads fp32):
    ``{precision: {"ops": per run, "share": of the heavy ops' kernel time}}``, plus the op types and the providers."""
    time: dict[str, float] = defaultdict(float)
    ops: dict[str, int] = defaultdict(int)
    for ev in events:
        args = ev.get("args", {})
        op = args.get("op_name", "")
        if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time") or op not in INT8_KERNELS | FLOAT_KERNELS:
            continue
        first = next(iter((args.get("input_type_shape") or [{}])[0]), "float")
        precision = "int8" if op in INT8_KERNELS else _FLOAT_TYPES.get(first, first)
        time[precision] += ev.get("dur", 0)
        ops[precision] += 1
    total = sum(time.values())
    return {p: {"ops": ops[p] // max(1, runs), "share": round(time[p] / total if total else ops[p] / sum(ops.values()), 3)}
            for p in sorted(ops, key=lambda p: -time[p])}


def precision_from_kernels(graph: str, kernels: dict[str, dict[str, float]]) -> str:
    """What a session computed in, from ``kernels_ran``: the precision holding most of the heavy ops' kernel time, with
    how much of it where not all, and the graph's own precision where that is not what ran (a QDQ graph left unfused, an
    fp16 graph computed through casts). No heavy op at all: the graph's precision."""
    if not kernels:
        return graph
    ran = max(kernels, key=lambda p: kernels[p]["share"])
    n, m = int(sum(k["ops"] for k in kernels.values())), int(kernels[ran]["ops"])
    part = "" if m == n else f", {kernels[ran]['share']:.0%} of their time"
    if ran == "int8":
        form = graph[len("int8 ("):-1] if graph.startswith("int8 (") else "integer kernels"
        return f"int8 ({form}, {m}/{n} heavy ops{part})"
    if graph == ran and m == n:
        return graph
    described = f"INT8 {graph[len('int8 ('):-1]}" if graph.startswith("int8 (") else graph
    return f"{ran} ({described} graph: {m}/{n} heavy ops{part} ran in {ran} kernels)"


_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
                "tensor(bool)": np.bool_}


def synthetic_feed(sess) -> dict[str, np.ndarray]:
    """Zeros of each input's type, named dimensions set to 1 (a session's read-back before it has seen real inputs)."""
    return {i.name: np.zeros([d if isinstance(d, int) and d > 0 else 1 for d in i.shape], _NUMPY_TYPES.get(i.type, np.float32))
            for i in sess.get_inputs()}


# Model metadata a graph saved in ONNX Runtime's NCHWc layout carries: the block it was written in (``passes.onnx_passes.
# stamp_nchwc_block``).
NCHWC_BLOCK_KEY = "servopt.nchwc_block"


def check_nchwc_block(metadata: dict[str, str], path: str, here: CpuFeatures) -> None:
    """Refuse a graph saved in another CPU's NCHWc block: ONNX Runtime loads and runs it, and answers wrongly."""
    built, block = metadata.get(NCHWC_BLOCK_KEY), here.nchwc_block
    if built and block and int(built) != block:
        raise UserError(f"{path} was optimized offline (level all) on a CPU whose ONNX Runtime lays convolutions out in "
                        f"blocks of {built} channels; this CPU's uses {block}: it would load and answer wrongly",
                        fix="deploy the unoptimized ONNX model (ONNX Runtime optimizes it at load on this CPU), or "
                            "run `servopt optimize` on a CPU of this kind, which saves the graph in its block")


class OrtSession(Session):
    def __init__(self, path: str, options: OrtOptions, default_providers: list[str], profile_prefix: str | None = None) -> None:
        import onnxruntime as ort

        self.path, self.options = path, options
        self.requested = list(options.providers or default_providers)
        for option, what in (("trt_fp16", "FP16"), ("trt_int8", "INT8")):
            if getattr(options, option) and TRT not in self.requested:
                raise UserError(f"{option} asks TensorRT for {what} kernels, but the providers are {self.requested}",
                                fix=f"put {TRT} in the providers option")
        available = ort.get_available_providers()
        chosen = [p for p in self.requested if p in available] or [CPU]
        providers = [(p, provider_options(p, options)) if provider_options(p, options) else p for p in chosen]
        self.disabled = disabled_fusions(options, chosen[0])
        try:
            self.sess = ort.InferenceSession(path, sess_options=session_options(options, profile_prefix), providers=providers,
                                             disabled_optimizers=self.disabled)
        except Exception as e:
            raise UserError(f"ONNX Runtime cannot load {path}: {str(e).splitlines()[0]}", fix="check the model file") from e
        check_nchwc_block(self.sess.get_modelmeta().custom_metadata_map, path, host_features())
        self.input_names = [i.name for i in self.sess.get_inputs()]
        self.output_names = [o.name for o in self.sess.get_outputs()]
        self.feed: dict[str, np.ndarray] | None = None
        self._ran: dict[str, dict[str, float]] | None = None

    def run_prepared(self, prepared: dict[str, np.ndarray]) -> np.ndarray:
        return self.sess.run(self.output_names[:1], prepared)[0]

    def warm_up(self, feed: dict[str, np.ndarray]) -> float:
        self.feed = feed  # the model's own inputs, for the read-back of what ran
        return super().warm_up(feed)

    def _kernels(self, graph: str, provider: str) -> tuple[dict[str, dict[str, float]] | None, str]:
        """The heavy ops' kernels a profiled twin of this session ran (same options and providers, ``READBACK_RUNS``
        calls on the warm-up inputs, else zeros), once per session; None and why where it is not read that way. An fp32
        graph asked for nothing lower is not profiled: no provider here lowers it unasked, and the twin loads the model
        again (a 436 MB fp32 encoder: 8.1 s, its load 5.0 s; its dynamic INT8 graph: 0.6 s; Intel Xeon Emerald Rapids,
        2 shared cores)."""
        if provider == TRT:
            return None, "the graph's operators and the options TensorRT ran with (its engine is one fused node to the profiler)"
        if graph == "fp32" and self.options.precision in (None, "fp32") and not self.options.trt_fp16:
            return None, "the graph's operators (fp32, and nothing lower asked for)"
        if self._ran is None:
            feed = self.feed or synthetic_feed(self.sess)
            try:
                self._ran = kernels_ran(self._profiled(self.options.model_copy(update={"optimized_model_filepath": None}),
                                                       [feed], READBACK_RUNS), READBACK_RUNS)
            except (UserError, RuntimeError, OSError, ValueError) as e:  # e.g. a model that cannot run on zeros: say so
                return None, f"the graph's operators (the profiled read-back failed: {str(e).splitlines()[0][:200]})"
        return self._ran, ("the kernels ONNX Runtime's profiler saw run" if self._ran else
                           "the graph's operators (no convolution, matrix product or attention ran)")

    def _profiled(self, options: OrtOptions, feeds: list[dict[str, np.ndarray]], runs: int) -> list[dict]:
        """ONNX Runtime's profiler events over ``runs`` calls of a second session with profiling on."""
        with tempfile.TemporaryDirectory() as tmp:
            sess = OrtSession(self.path, options, self.requested, profile_prefix=str(Path(tmp) / "ort"))
            for i in range(runs):
                sess.run_prepared(feeds[i % len(feeds)])
            return json.loads(Path(sess.sess.end_profiling()).read_text())

    def info(self) -> SessionInfo:
        actual = self.sess.get_providers()
        ran_options = {p: dict(o) for p, o in self.sess.get_provider_options().items() if o and p in actual}
        so = self.sess.get_session_options()
        graph = graph_precision(self.path)
        kernels, source = self._kernels(graph, actual[0])
        return SessionInfo(
            runtime="onnxruntime", provider_requested=self.requested[0], provider_actual=actual[0],
            # ORT silently falls back to CPU when a provider cannot start (onnxruntime-gpu without a GPU): say so, and
            # verification fails on it (bench.protocol.ran_as_asked).
            provider_fallback=actual[0] != self.requested[0],
            precision_requested=self.options.precision or ("int8" if self.options.trt_int8 else "fp16" if self.options.trt_fp16 else None),
            precision_actual=(precision_from_kernels(graph, kernels) if kernels is not None
                              else precision_ran(graph, actual[0], ran_options.get(actual[0], {}))),
            threads=so.intra_op_num_threads or "default",
            details={"graph_optimization_level": self.options.graph_optimization_level, "providers": actual,
                     "provider_options": ran_options, "graph_precision": graph, "disabled_fusions": self.disabled,
                     "intra_op_spinning": spinning(self.options),
                     "kernels": kernels, "precision_source": source},
        )

    def profile(self, feeds: list[dict[str, np.ndarray]], runs: int, top: int) -> OpProfile:
        """ONNX Runtime's own profiler (a second session with profiling on), aggregated by operator type."""
        events = self._profiled(self.options, feeds, runs)
        times: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for ev in events:
            if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
                op = ev.get("args", {}).get("op_name", "?")
                times[op] += ev.get("dur", 0)
                calls[op] += 1
        return top_ops(times, calls, runs, top, "onnxruntime")


@register_runtime
class OnnxRuntime(Runtime):
    name = "onnxruntime"
    artifact_formats = ("onnx",)
    Options = OrtOptions
    thread_option = "intra_op_threads"
    servable = True
    triton_platform = "onnxruntime_onnx"
    requirements = ("onnxruntime",)
    libraries = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino")
    default_providers: tuple[str, ...] = (CPU,)

    def int8_kernel(self, quantized: Int8Kernel, options: dict) -> Int8Kernel:
        """MLAS runs the model's own product, except that ``session.x64quantprecision`` runs U8S8 on U8U8 kernels."""
        x64 = OrtOptions.model_validate(options).x64_quant_precision
        return "u8u8" if quantized in ("u8s8", "u8s8-7bit") and x64 else quantized

    def serving_options(self, options: OrtOptions) -> OrtOptions:
        # Not spinning at all, unless the user bounds it (``-o spin_duration_us=N``): a bounded spin made a lone
        # two-thread call 0.88x the time offline but not served (benchmarks/serve_spin.py, docs/benchmarks.md).
        if options.spin_duration_us is not None:
            return options
        return options.model_copy(update={"allow_spinning": False})

    def open(self, artifact: Artifact, options: OrtOptions) -> Session:
        return OrtSession(str(artifact.path), options, list(self.default_providers))


@register_runtime
class OnnxRuntimeCuda(OnnxRuntime):
    """ONNX Runtime on the CUDA / TensorRT providers: skipped honestly where no GPU exists."""

    name = "onnxruntime-cuda"
    device = Device.GPU
    requirements = ("onnxruntime-gpu",)
    default_providers = ("CUDAExecutionProvider", CPU)

    def environment(self):
        """``onnxruntime-gpu`` in an environment of its own, so a GPU host never has the CPU build overwritten; none
        where this interpreter's ``onnxruntime`` already is the GPU build (a GPU host provisioned ahead, with no
        registry to make an environment from)."""
        return None if gpu_build_here() else _gpu_environment()

    def available(self) -> tuple[bool, str]:
        if not gpu_present():
            return False, "no NVIDIA GPU on this machine"
        return True, ""


def gpu_build_here() -> bool:
    """Whether this interpreter has ``onnxruntime-gpu`` installed (read from its metadata: nothing is imported)."""
    from importlib import metadata

    try:
        metadata.version("onnxruntime-gpu")
    except metadata.PackageNotFoundError:
        return False
    return True


@lru_cache(maxsize=1)
def _gpu_environment():
    from importlib import metadata

    from servopt.envs import runtime_spec

    return runtime_spec("ort-gpu", [f"onnxruntime-gpu=={metadata.version('onnxruntime')}"])
