"""ONNX Runtime (CPU, and CUDA/TensorRT providers where a GPU exists)."""

from __future__ import annotations

import numpy as np

from servopt.errors import UserError
from servopt.runtimes.base import Runtime, Session, register_runtime

GRAPH_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


def session_options(options: dict):
    import onnxruntime as ort

    so = ort.SessionOptions()
    level = options.get("graph_optimization_level", "all")
    if level not in GRAPH_LEVELS:
        raise UserError(f"unknown graph optimization level {level!r}", fix=f"use one of {list(GRAPH_LEVELS)}")
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, GRAPH_LEVELS[level])
    if options.get("intra_op_threads"):
        so.intra_op_num_threads = int(options["intra_op_threads"])
    if options.get("inter_op_threads"):
        so.inter_op_num_threads = int(options["inter_op_threads"])
    if options.get("allow_spinning") is False:
        # Idle intra-op threads spin-wait by default; in a server they would steal the cores the event loop needs.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if options.get("optimized_model_filepath"):
        so.optimized_model_filepath = str(options["optimized_model_filepath"])
    if options.get("enable_profiling"):
        so.enable_profiling = True
        so.profile_file_prefix = str(options.get("profile_file_prefix", "ort_profile"))
    so.log_severity_level = 3
    return so


class OrtSession(Session):
    def __init__(self, path: str, options: dict) -> None:
        import onnxruntime as ort

        self.requested = list(options.get("providers", ["CPUExecutionProvider"]))
        available = ort.get_available_providers()
        providers = [p for p in self.requested if p in available] or ["CPUExecutionProvider"]
        self.options = options
        so = session_options(options)
        try:
            self.sess = ort.InferenceSession(path, sess_options=so, providers=providers)
        except Exception as e:
            raise UserError(f"ONNX Runtime cannot load {path}: {str(e).splitlines()[0]}", fix="check the model file") from e
        self.input_names = [i.name for i in self.sess.get_inputs()]
        self.output_names = [o.name for o in self.sess.get_outputs()]

    def run_prepared(self, prepared: dict[str, np.ndarray]) -> np.ndarray:
        return self.sess.run(self.output_names[:1], prepared)[0]

    def end_profiling(self) -> str:
        return self.sess.end_profiling()

    def info(self) -> dict:
        actual = self.sess.get_providers()
        so = self.sess.get_session_options()
        return {
            "runtime": "onnxruntime",
            "provider_requested": self.requested[0],
            "provider_actual": actual[0],
            # ORT silently falls back to CPU when a provider cannot start: say so.
            "provider_fallback": actual[0] != self.requested[0],
            "graph_optimization_level": self.options.get("graph_optimization_level", "all"),
            "intra_op_threads": so.intra_op_num_threads or "default",
        }


@register_runtime
class OnnxRuntime(Runtime):
    name = "onnxruntime"
    artifact_formats = ("onnx",)

    def open(self, artifact: dict, options: dict) -> Session:
        return OrtSession(artifact["path"], options)

    def validate_options(self, options: dict) -> None:
        session_options(options)


@register_runtime
class OnnxRuntimeCuda(OnnxRuntime):
    """ONNX Runtime on the CUDA / TensorRT providers: skipped honestly where no GPU exists."""

    name = "onnxruntime-cuda"
    needs_gpu = True

    def available(self) -> tuple[bool, str]:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return False, "onnxruntime here has no CUDA provider (install onnxruntime-gpu on a GPU machine)"
        from servopt.bench.environment import gpu_present

        if not gpu_present():
            return False, "no NVIDIA GPU on this machine"
        return True, ""

    def open(self, artifact: dict, options: dict) -> Session:
        opts = {"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"], **options}
        return OrtSession(artifact["path"], opts)
