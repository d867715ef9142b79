"""OpenVINO on the CPU, with its LATENCY / THROUGHPUT performance hints, a pinned inference precision, and its threads
kept where they are asked to be.

OpenVINO's CPU plugin picks bf16 on its own where the CPU has bf16 arithmetic
(``INFERENCE_PRECISION_HINT`` answers ``bfloat16`` on AVX512-BF16 and AMX
CPUs), so a variant says which precision it means and the session pins it;
the precision the compiled model actually runs is read back from its runtime
model (the precision of its compute layers), never assumed.

Threads: ``INFERENCE_NUM_THREADS`` alone does not keep a one-thread instance to
a core of its own. On Linux the CPU plugin pins each compiled model's stream
(``ENABLE_CPU_PINNING``, on by default) to the *first* cores of the machine, and
nothing reserves them (``ENABLE_CPU_RESERVATION`` is off): two one-thread
compiled models, in one process or in two, both ran on core 0 (the calling
thread's affinity read ``[0]`` during ``infer``, each thread 49 % of a core:
``tests/test_threads.py``). So a session of fewer threads than the cores this
process may use is not pinned (``pinning``), and the OS spreads the instances.
Reservation would give each model a core of its own within one process, but
takes the cores from the server's solo session and knows nothing of other
processes. Streams stay 1 under the LATENCY hint; hyper-threading and core-type
hints change nothing on a CPU with one thread per core and one core type.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from typing import Literal

import numpy as np

from servopt.contracts import Artifact, OpProfile, SessionInfo
from servopt.cpu import Int8Kernel, Isa
from servopt.errors import UserError
from servopt.runtimes.base import ONEDNN_ISA, Runtime, RuntimeOptions, Session, register_runtime, takes_every_core, top_ops

# servopt's precision names → OpenVINO's element types for INFERENCE_PRECISION_HINT.
PRECISIONS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
_RUNTIME_PRECISION = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "u8": "int8", "i8": "int8"}
_COMPUTE_LAYERS = {"Convolution", "GroupConvolution", "FullyConnected", "MatMul", "Deconvolution"}


class OpenVinoOptions(RuntimeOptions):
    hint: Literal["LATENCY", "THROUGHPUT"] = "LATENCY"
    threads: int | None = None
    # "default" leaves the choice to the plugin (bf16 on CPUs with bf16 arithmetic): named for what it runs only
    # after reading it back, so the catalogue never uses it.
    precision: Literal["fp32", "bf16", "fp16", "default"] = "fp32"
    # ENABLE_CPU_PINNING; None: pinned only when the session's threads take every core this process may use (see the
    # module's docstring: partial sessions pinned to the same first cores share them).
    cpu_pinning: bool | None = None


def pinning(options: OpenVinoOptions) -> bool:
    """Whether a session's threads are pinned: as asked, else only when they take every usable core (then nothing of
    this process is left for another instance to run on, and pinning keeps each thread on its core)."""
    return options.cpu_pinning if options.cpu_pinning is not None else takes_every_core(options.threads)


def compile_config(options: OpenVinoOptions) -> dict:
    """The CPU plugin's properties for ``options``: the hint, threads, pinning and the pinned float precision."""
    config: dict = {"PERFORMANCE_HINT": options.hint, "ENABLE_CPU_PINNING": pinning(options)}
    if options.threads:
        config["INFERENCE_NUM_THREADS"] = int(options.threads)
    if options.precision != "default":
        config["INFERENCE_PRECISION_HINT"] = PRECISIONS[options.precision]
    return config


def compute_layers(compiled) -> tuple[str, dict[str, int], dict[str, int]]:
    """What the compiled model's compute layers (convolutions, matrix products) run: the most common precision, the
    count per precision, and the count per kernel (``brgconv_avx512_f32``, ``gemm_mlas_f32`` …: the ISA path)."""
    precisions: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        layer = info["layerType"].astype(str) if "layerType" in info else ""
        if layer not in _COMPUTE_LAYERS:
            continue
        if "runtimePrecision" in info:
            ran = info["runtimePrecision"].astype(str).lower()
            precisions[_RUNTIME_PRECISION.get(ran, ran)] += 1
        if "primitiveType" in info:
            kernels[info["primitiveType"].astype(str)] += 1
    return (precisions.most_common(1)[0][0] if precisions else "unknown"), dict(precisions), dict(kernels)


class OpenVinoSession(Session):
    def __init__(self, artifact: Artifact, options: OpenVinoOptions) -> None:
        import openvino as ov

        core = ov.Core()
        self.options = options
        try:
            self.model = core.read_model(str(artifact.path))
            self.compiled = core.compile_model(self.model, "CPU", compile_config(options))
        except Exception as e:
            raise UserError(f"OpenVINO cannot load {artifact.path}: {str(e).splitlines()[0]}",
                            fix="check the model, or ask for a precision this CPU has") from e
        self.request = self.compiled.create_infer_request()
        self.input_names = [i.get_any_name() for i in self.compiled.inputs]
        self.output = self.compiled.outputs[0]
        self.queue = None
        if options.hint == "THROUGHPUT":
            # The THROUGHPUT hint splits the CPU into streams that only parallel requests can fill: a batch is cut
            # into one slice per stream and run through an AsyncInferQueue (one synchronous request uses one stream).
            self.queue = ov.AsyncInferQueue(self.compiled, int(self.compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")))

    def run_prepared(self, prepared: dict[str, np.ndarray]) -> np.ndarray:
        n = len(next(iter(prepared.values())))
        if self.queue is None or n < 2 or len(self.queue) < 2:
            # share_inputs avoids a copy; the outputs are copied out so callers may keep them.
            return np.array(self.request.infer(prepared, share_inputs=True)[self.output])
        bounds = np.linspace(0, n, min(len(self.queue), n) + 1).astype(int)
        parts: dict[int, np.ndarray] = {}
        self.queue.set_callback(lambda request, index: parts.__setitem__(index, np.array(request.get_output_tensor(0).data)))
        for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            self.queue.start_async({k: v[lo:hi] for k, v in prepared.items()}, userdata=i, share_inputs=True)
        self.queue.wait_all()
        return np.concatenate([parts[i] for i in range(len(bounds) - 1)])

    def info(self) -> SessionInfo:
        hint = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        actual, layers, kernels = compute_layers(self.compiled)
        # A quantized model (FakeQuantize: NNCF's IR, or an ONNX QDQ model as OpenVINO reads it) asks for INT8 compute
        # layers; the precision option then pins only what stays in float.
        quantized = any(op.get_type_name() == "FakeQuantize" for op in self.model.get_ordered_ops())
        return SessionInfo(
            runtime="openvino", provider_requested="CPU", provider_actual="CPU",
            precision_requested="int8" if quantized else None if self.options.precision == "default" else self.options.precision,
            precision_actual=actual, threads=int(self.compiled.get_property("INFERENCE_NUM_THREADS")) or "default",
            details={"hint": self.options.hint, "streams": int(self.compiled.get_property("NUM_STREAMS")),
                     "cpu_pinning": bool(self.compiled.get_property("ENABLE_CPU_PINNING")),
                     "parallel_requests": len(self.queue) if self.queue is not None else 1,
                     "inference_precision_hint": hint, "float_precision": self.options.precision,
                     "compute_layer_precisions": layers, "kernels": kernels,
                     "precision_source": "the compiled model's runtime precision of its compute layers"},
        )

    def profile(self, feeds: list[dict[str, np.ndarray]], runs: int, top: int) -> OpProfile:
        """OpenVINO's performance counters, aggregated by executed layer type."""
        import openvino as ov

        request = ov.Core().compile_model(self.model, "CPU", {**compile_config(self.options), "PERF_COUNT": True}).create_infer_request()
        times: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for i in range(runs):
            request.infer(feeds[i % len(feeds)])
            for info in request.get_profiling_info():
                if info.status == info.Status.EXECUTED:
                    times[info.node_type] += info.real_time.total_seconds() * 1e6
                    calls[info.node_type] += 1
        return top_ops(times, calls, runs, top, "openvino")


@register_runtime
class OpenVinoRuntime(Runtime):
    name = "openvino"
    artifact_formats = ("onnx", "openvino")
    Options = OpenVinoOptions
    thread_option = "threads"
    servable = True
    triton_platform = "openvino"
    requirements = ("openvino",)
    libraries = ("openvino", "nncf")

    def available(self) -> tuple[bool, str]:
        try:
            import openvino  # noqa: F401
        except ImportError:
            return False, "openvino is not installed (pip install servopt[openvino])"
        return True, ""

    def int8_kernel(self, quantized: Int8Kernel, options: dict) -> Int8Kernel:
        """oneDNN multiplies u8 by s8 on x86, signed activations shifted by 128 into that product: fast with VNNI, in
        saturating int16 pairs without (ORT's QDQ S8S8 MobileNetV2 run by OpenVINO scored 70.1 % top-1 on an AVX2 CPU
        against 97.3 % on a VNNI one; qemu's EPYC-Milan, ``benchmarks/avx2_quality.py``). The rest runs as quantized."""
        return "u8s8" if quantized == "s8s8" else quantized

    def isa_cap_env(self, level: Isa) -> dict[str, str] | None:
        """oneDNN honours ONEDNN_MAX_CPU_ISA (convolutions: brgconv_avx512 → brgconv_avx2, read back in ``kernels``);
        OpenVINO's own JIT kernels and its MLAS fully-connected path are not capped in release builds, so the cap is
        partial and the session's ``kernels`` say which ran."""
        return {"ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[level]} if level in ONEDNN_ISA else None

    def open(self, artifact: Artifact, options: OpenVinoOptions) -> Session:
        return OpenVinoSession(artifact, options)
