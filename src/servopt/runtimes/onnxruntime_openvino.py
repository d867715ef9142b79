"""ONNX Runtime with Intel's OpenVINO execution provider, in a Python environment of its own.

``onnxruntime-openvino`` installs the same ``onnxruntime`` module as the plain
build and would overwrite it, so this runtime declares its own environment
(``environment``): the launcher creates it on first use and runs this runtime's
jobs with its interpreter. The provider that actually ran is read back from the
session (a device it cannot open falls back to ONNX Runtime's CPU provider, and
the record says so, and verification fails). The precision it computed in cannot
be read back: the EP does not report its options (``get_provider_options`` is
empty), runs its partition as one fused node (ONNX Runtime's profiler names
``OpenVINO-EP-subgraph_N``, not the kernels inside: seen with 1.24.1 on a conv
net and on its QDQ graph), and exposes no compiled model to ask. The record says ``unknown`` and why, with what was asked and what
the graph holds, rather than the request read back as if it were a measurement.
Found by creating the env here (onnxruntime-openvino 1.24.1,
which bundles its own OpenVINO 2025.4 libraries): CPU accepts only FP32 and
ACCURACY precision; performance hints go through ``load_config``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Literal

import numpy as np

from servopt.contracts import Artifact, SessionInfo
from servopt.errors import UserError
from servopt.runtimes.base import Runtime, RuntimeOptions, Session, register_runtime, takes_every_core

VERSION = "1.24.1"  # the newest onnxruntime-openvino for CPython 3.11 on x86-64 on PyPI when this was written
PROVIDER = "OpenVINOExecutionProvider"
UNREADABLE = "unknown"  # verification then checks the provider only (bench.protocol.ran_as_asked)
UNREADABLE_WHY = ("not readable: the OpenVINO EP reports neither its options nor its compiled model's precisions, and "
                  "ONNX Runtime's profiler sees its partition as one fused node; asked for and the graph's own are in details")


class OrtOpenVinoOptions(RuntimeOptions):
    device_type: Literal["CPU", "GPU", "NPU"] = "CPU"
    precision: Literal["FP32", "ACCURACY"] = "FP32"  # the CPU device accepts these two only
    num_of_threads: int | None = None
    num_streams: int | None = None
    hint: Literal["LATENCY", "THROUGHPUT"] = "LATENCY"
    # OpenVINO's ENABLE_CPU_PINNING (through load_config); None: pinned only when the session takes every usable core
    # (``base.takes_every_core``: two pinned one-thread sessions share the first core, as with ``openvino``).
    cpu_pinning: bool | None = None


def pinned(options: OrtOpenVinoOptions) -> bool:
    """Whether OpenVINO is asked to pin the session's threads: as the options say, else only when it takes every core."""
    return options.cpu_pinning if options.cpu_pinning is not None else takes_every_core(options.num_of_threads)


class OrtOpenVinoSession(Session):
    def __init__(self, path: str, options: OrtOpenVinoOptions) -> None:
        import onnxruntime as ort

        self.options, self.path = options, path
        if PROVIDER not in ort.get_available_providers():
            raise UserError(f"this onnxruntime ({ort.__version__}) has no {PROVIDER}",
                            fix="run it in the onnxruntime-openvino environment servopt creates (see `servopt env list`)")
        provider = {"device_type": options.device_type, "precision": options.precision,
                    # The hint and a pinned fp32 inference precision go to OpenVINO through load_config.
                    "load_config": json.dumps({options.device_type: {"PERFORMANCE_HINT": options.hint,
                                                                     "INFERENCE_PRECISION_HINT": "f32",
                                                                     "ENABLE_CPU_PINNING": pinned(options)}})}
        if options.num_of_threads:
            provider["num_of_threads"] = str(options.num_of_threads)
        if options.num_streams:
            provider["num_streams"] = str(options.num_streams)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        try:
            self.sess = ort.InferenceSession(path, so, providers=[(PROVIDER, provider), "CPUExecutionProvider"])
        except Exception as e:
            raise UserError(f"ONNX Runtime (OpenVINO EP) cannot load {path}: {str(e).splitlines()[0]}", fix="check the model") from e
        self.input_names = [i.name for i in self.sess.get_inputs()]
        self.output_names = [o.name for o in self.sess.get_outputs()]

    def run_prepared(self, prepared: dict[str, np.ndarray]) -> np.ndarray:
        return self.sess.run(self.output_names[:1], prepared)[0]

    def info(self) -> SessionInfo:
        import onnxruntime as ort

        from servopt.runtimes.onnxruntime_runtime import graph_precision

        actual = self.sess.get_providers()
        # An INT8 (QDQ) graph asks for INT8 whatever the float precision pinned for the rest.
        graph = graph_precision(self.path)
        floating = "fp32" if self.options.precision == "FP32" else None
        return SessionInfo(
            runtime="onnxruntime-openvino", provider_requested=f"{PROVIDER}:{self.options.device_type}",
            provider_actual=actual[0] if actual[0] != PROVIDER else f"{PROVIDER}:{self.options.device_type}",
            provider_fallback=actual[0] != PROVIDER, precision_requested="int8" if graph.startswith("int8") else floating,
            precision_actual=UNREADABLE,
            threads=self.options.num_of_threads or "default",
            details={"hint": self.options.hint, "cpu_pinning_asked": pinned(self.options), "onnxruntime": ort.__version__, "providers": actual, "graph_precision": graph,
                     "precision_option": self.options.precision, "inference_precision_hint": "f32",
                     "precision_source": UNREADABLE_WHY})


@lru_cache(maxsize=1)
def _environment():
    from servopt.envs import runtime_spec

    return runtime_spec("ort-openvino", [f"onnxruntime-openvino=={VERSION}"])


@register_runtime
class OnnxRuntimeOpenVino(Runtime):
    name = "onnxruntime-openvino"
    artifact_formats = ("onnx",)
    Options = OrtOpenVinoOptions
    thread_option = "num_of_threads"
    servable = True
    triton_platform = "onnxruntime_onnx"
    requirements = (f"onnxruntime-openvino=={VERSION}",)
    libraries = ("onnxruntime-openvino",)

    def environment(self):
        return _environment()

    def open(self, artifact: Artifact, options: OrtOpenVinoOptions) -> Session:
        return OrtOpenVinoSession(str(artifact.path), options)
