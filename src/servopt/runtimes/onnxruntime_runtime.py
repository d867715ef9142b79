"""ONNX Runtime (CPU, and CUDA/TensorRT providers where a GPU exists)."""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np

from servopt.contracts import Artifact, OpProfile, SessionInfo
from servopt.errors import UserError
from servopt.machine import Device, gpu_present
from servopt.runtimes.base import Runtime, RuntimeOptions, Session, register_runtime, top_ops

GRAPH_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


class OrtOptions(RuntimeOptions):
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    # Idle intra-op threads spin-wait by default; in a server they would steal the cores the event loop needs.
    allow_spinning: bool = True
    providers: list[str] | None = None
    optimized_model_filepath: str | None = None  # write the optimized graph (the offline-optimization pass)
    # x86 without VNNI: U8U8 kernels instead of U8S8 ones, which saturate there (``CpuFeatures.int8_saturates``).
    x64_quant_precision: bool = False


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
    if options.x64_quant_precision:
        so.add_session_config_entry("session.x64quantprecision", "1")
    if options.optimized_model_filepath:
        so.optimized_model_filepath = str(options.optimized_model_filepath)
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    so.log_severity_level = 3
    return so


def graph_precision(path: str) -> str:
    """The precision the graph itself runs in, from its operators: ONNX Runtime has no other record of it."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    if ops & {"QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd"}:
        return "int8 (QOperator)"
    if ops & {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul"}:
        return "int8 (dynamic)"
    if "QuantizeLinear" in ops and "DequantizeLinear" in ops:
        return "int8 (QDQ)"
    if any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer):
        return "fp16"
    return "fp32"


class OrtSession(Session):
    def __init__(self, path: str, options: OrtOptions, default_providers: list[str], profile_prefix: str | None = None) -> None:
        import onnxruntime as ort

        self.path, self.options = path, options
        self.requested = list(options.providers or default_providers)
        available = ort.get_available_providers()
        providers = [p for p in self.requested if p in available] or ["CPUExecutionProvider"]
        try:
            self.sess = ort.InferenceSession(path, sess_options=session_options(options, profile_prefix), providers=providers)
        except Exception as e:
            raise UserError(f"ONNX Runtime cannot load {path}: {str(e).splitlines()[0]}", fix="check the model file") from e
        self.input_names = [i.name for i in self.sess.get_inputs()]
        self.output_names = [o.name for o in self.sess.get_outputs()]

    def run_prepared(self, prepared: dict[str, np.ndarray]) -> np.ndarray:
        return self.sess.run(self.output_names[:1], prepared)[0]

    def info(self) -> SessionInfo:
        actual = self.sess.get_providers()
        so = self.sess.get_session_options()
        precision = graph_precision(self.path)
        return SessionInfo(
            runtime="onnxruntime", provider_requested=self.requested[0], provider_actual=actual[0],
            # ORT silently falls back to CPU when a provider cannot start: say so.
            provider_fallback=actual[0] != self.requested[0], precision_actual=precision,
            threads=so.intra_op_num_threads or "default",
            details={"graph_optimization_level": self.options.graph_optimization_level, "providers": actual,
                     "precision_source": "the graph's operators"},
        )

    def profile(self, feeds: list[dict[str, np.ndarray]], runs: int, top: int) -> OpProfile:
        """ONNX Runtime's own profiler (a second session with profiling on), aggregated by operator type."""
        with tempfile.TemporaryDirectory() as tmp:
            sess = OrtSession(self.path, self.options, self.requested, profile_prefix=str(Path(tmp) / "ort"))
            for i in range(runs):
                sess.run_prepared(feeds[i % len(feeds)])
            events = json.loads(Path(sess.sess.end_profiling()).read_text())
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
    default_providers: tuple[str, ...] = ("CPUExecutionProvider",)

    def serving_options(self, options: OrtOptions) -> OrtOptions:
        return options.model_copy(update={"allow_spinning": False})

    def open(self, artifact: Artifact, options: OrtOptions) -> Session:
        return OrtSession(str(artifact.path), options, list(self.default_providers))


@register_runtime
class OnnxRuntimeCuda(OnnxRuntime):
    """ONNX Runtime on the CUDA / TensorRT providers: skipped honestly where no GPU exists."""

    name = "onnxruntime-cuda"
    device = Device.GPU
    requirements = ("onnxruntime-gpu",)
    default_providers = ("CUDAExecutionProvider", "CPUExecutionProvider")

    def environment(self):
        """``onnxruntime-gpu`` in an environment of its own, so a GPU host never has the CPU build overwritten."""
        return _gpu_environment()

    def available(self) -> tuple[bool, str]:
        if not gpu_present():
            return False, "no NVIDIA GPU on this machine"
        return True, ""


@lru_cache(maxsize=1)
def _gpu_environment():
    from importlib import metadata

    from servopt.envs import runtime_spec

    return runtime_spec("ort-gpu", [f"onnxruntime-gpu=={metadata.version('onnxruntime')}"])
