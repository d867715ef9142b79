"""PyTorch: eager (plain, eval, no_grad, inference_mode), channels_last, torch.compile, dynamic INT8, bf16/fp16.

The artifact is a reference to the source model (``Artifact.ref``); the
transforms are applied when the session opens, so compile time lands in the
cold-start figure where it belongs.

Threads: ``torch.set_num_threads`` is one setting for the whole process, read by
each thread when it first runs a parallel operator, while OpenMP keeps a thread
count per calling thread. A session that set it once at open was overridden by
the next session opened: the scaling measurement's two-thread session, opened
after two one-thread instances, made each instance run two OpenMP threads (four
busy threads on two cores, 0.23-0.30 of a core each), and a server's solo
session inherited its instances' one thread. So each session sets its count in
the thread that calls it, at every call (well under a microsecond): OpenMP then
holds each calling thread to its own session's count.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, defaultdict
from functools import lru_cache
from typing import Literal

import numpy as np

from servopt.contracts import Artifact, OpProfile, SessionInfo
from servopt.cpu import Isa
from servopt.errors import UserError
from servopt.machine import Device, usable_cores
from servopt.runtimes.base import ONEDNN_ISA, Runtime, RuntimeOptions, Session, register_runtime, top_ops

# glibc returns large tensor buffers to the OS after every forward unless told not to; set in a process's
# environment before it starts, this took eager batch-32 from 26 to 91 img/s here (FIELD-NOTES), training too.


class TorchOptions(RuntimeOptions):
    device: Literal["cpu", "cuda"] = "cpu"
    threads: int | None = None
    # How the module is called: the lab compares a plain module (training mode, autograd on) with eval(),
    # eval()+no_grad and eval()+inference_mode.
    grad_mode: Literal["plain", "eval", "no_grad", "inference_mode"] = "inference_mode"
    channels_last: bool = False
    compile: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = None
    compile_dynamic: bool | None = None  # torch.compile(dynamic=…): varying sequence lengths without recompiles
    freezing: bool = False
    quantize_dynamic: bool = False
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    autocast: bool = False  # reduced precision through torch.autocast (weights stay fp32) instead of casting


class TorchSession(Session):
    def __init__(self, artifact: Artifact, options: TorchOptions) -> None:
        import torch

        from servopt.models.sources import LoadedModel

        if artifact.ref is None:
            raise UserError("a torch artifact needs a model reference", fix="build it from a torch source")
        self.torch = torch
        self.options = options
        self.threads = int(options.threads) if options.threads else default_threads(torch)
        torch.set_num_threads(self.threads)  # for loading and compiling; every call sets it again (_context)
        model = LoadedModel.from_ref(artifact.ref)
        self.input_names = model.spec.input_names
        self.device = options.device
        module = model.torch_module()
        if options.grad_mode == "plain":
            module.train()  # the lab's baseline: as a notebook leaves a freshly built module
        if options.quantize_dynamic:
            module = torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)
        if options.channels_last:
            module = module.to(memory_format=torch.channels_last)
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[options.dtype]
        if self.device != "cpu":
            module = module.to(self.device)
        if self.dtype is not None and not options.autocast:
            module = module.to(self.dtype)
        if options.compile:
            if options.freezing:
                import torch._inductor.config as inductor_config

                inductor_config.freezing = True
            mode = None if options.compile == "default" else options.compile
            module = torch.compile(module, mode=mode, dynamic=options.compile_dynamic)
        self.module = module
        self.recompiles = 0
        self._probe: list | None = None  # the warm-up's inputs: what the precision read-back runs
        self._ran: dict[str, int] | None = None

    def _context(self):
        torch = self.torch
        torch.set_num_threads(self.threads)  # this calling thread's OpenMP count: see the module's docstring
        stack = contextlib.ExitStack()
        mode = self.options.grad_mode
        if mode == "inference_mode":
            stack.enter_context(torch.inference_mode())
        elif mode == "no_grad":
            stack.enter_context(torch.no_grad())
        if self.options.autocast and self.dtype is not None:
            stack.enter_context(torch.autocast(self.device, dtype=self.dtype))
        return stack

    def prepare(self, feed: dict[str, np.ndarray]):
        torch = self.torch
        tensors = []
        for name in self.input_names:
            t = torch.from_numpy(np.ascontiguousarray(feed[name]))
            if self.options.channels_last and t.dim() == 4:
                t = t.contiguous(memory_format=torch.channels_last)
            if self.device != "cpu":
                t = t.to(self.device)
            if self.dtype is not None and not self.options.autocast and t.is_floating_point():
                t = t.to(self.dtype)
            tensors.append(t)
        return tensors

    def run_prepared(self, prepared):
        with self._context():
            out = self.module(*prepared)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if self.device != "cpu":
            self.torch.cuda.synchronize()
        return out

    def to_numpy(self, output) -> np.ndarray:
        return output.detach().float().cpu().numpy()

    def warm_up(self, feed: dict[str, np.ndarray]) -> float:
        """Run once; with torch.compile this compiles, and the seconds are reported (they count as cold start)."""
        start = time.perf_counter()
        self.run(feed)
        took = time.perf_counter() - start
        self._probe = self.prepare(feed)
        return took if self.options.compile else 0.0

    def compute_dtypes(self) -> dict[str, int] | None:
        """What the module's convolutions and matrix products computed in, op by op, on the warm-up's inputs (None before
        a warm-up): one eager call under the session's own context (grad mode, autocast), watched below autocast, so a
        cast, an autocast that did not apply or a quantized kernel shows as what it is. A compiled module is watched
        through its eager original (the compiled graph is the same computation; watching it would change it)."""
        if self._ran is None and self._probe is not None:
            watcher = _compute_watcher(self.torch)()
            with self._context(), watcher:
                getattr(self.module, "_orig_mod", self.module)(*self._probe)
            self._ran = dict(watcher.counts)
        return self._ran

    def _weights(self) -> str:
        params = [p for p in self.module.parameters() if p.is_floating_point()]
        return _DTYPES.get(str(params[0].dtype).removeprefix("torch."), "?") if params else "none"

    def _precision(self) -> tuple[str, str]:
        """(what ran, where that was read from)."""
        ran, weights = self.compute_dtypes(), self._weights()
        if not ran:
            return weights, "the module's parameters (not run yet, or no convolution or matrix product seen)"
        source = "the dtypes its convolutions and matrix products produced on one input"
        total, int8 = sum(ran.values()), ran.get("int8", 0)
        if int8:
            return f"int8 (dynamic, {int8} of {total} compute ops)", source
        name = max(ran, key=lambda k: ran[k])
        return (name if name == weights else f"{name} (computed over {weights} weights)"), source

    def info(self) -> SessionInfo:
        torch = self.torch
        mode = f"compile:{self.options.compile}" if self.options.compile else f"eager+{self.options.grad_mode}"
        actual, source = self._precision()
        return SessionInfo(
            runtime="torch", provider_requested=self.options.device, provider_actual=self.device,
            precision_requested=self.options.dtype if not self.options.quantize_dynamic else "int8",
            precision_actual=actual, threads=self.threads,
            details={"mode": mode, "channels_last": self.options.channels_last, "autocast": self.options.autocast,
                     "cpu_capability": torch.backends.cpu.get_cpu_capability(), "compute_ops": self._ran or {},
                     "precision_source": source},
        )

    def profile(self, feeds: list[dict[str, np.ndarray]], runs: int, top: int) -> OpProfile:
        """torch.profiler, aggregated by aten / mkldnn operator."""
        torch = self.torch
        prepared = [self.prepare(f) for f in feeds]
        self.run_prepared(prepared[0])
        times: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i in range(runs):
                self.run_prepared(prepared[i % len(prepared)])
        for ev in prof.key_averages():
            if ev.key.startswith(("aten::", "mkldnn", "onednn")):
                times[ev.key] += ev.self_cpu_time_total
                calls[ev.key] += ev.count
        return top_ops(times, calls, runs, top, "torch.profiler")


@lru_cache(maxsize=1)
def default_threads(torch) -> int:
    """A session's threads when none are asked: torch's own default (``OMP_NUM_THREADS``, else the cores it sees), read
    once, before any session set it (a later read returns the last session's count), and no more than the cores this
    process may use (``OMP_NUM_THREADS`` may name more)."""
    return max(1, min(torch.get_num_threads(), usable_cores()))


_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
# Dispatcher-level names of the ops that carry a model's arithmetic (convolutions, matrix products, attention).
_COMPUTE_OPS = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "mkldnn_convolution", "conv_transpose1d",
                "conv_transpose2d", "conv_transpose3d", "linear", "addmm", "mm", "bmm", "baddbmm", "matmul", "einsum",
                "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_attention_math", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_flash_attention"}


@lru_cache(maxsize=1)
def _compute_watcher(torch):
    """A dispatch mode that counts the compute ops it sees by the precision they produce (``quantized::`` ops: int8)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ComputeWatcher(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace == "quantized":
                self.counts["int8"] += 1
            elif func.overloadpacket.__name__ in _COMPUTE_OPS:
                first = out[0] if isinstance(out, (tuple, list)) else out
                if isinstance(first, torch.Tensor):
                    dtype = str(first.dtype).removeprefix("torch.")
                    self.counts[_DTYPES.get(dtype, dtype)] += 1
            return out

    return ComputeWatcher


@register_runtime
class TorchRuntime(Runtime):
    name = "torch"
    artifact_formats = ("torch",)
    Options = TorchOptions
    thread_option = "threads"
    triton_platform = "pytorch_libtorch"
    requirements = ("torch",)
    libraries = ("torch",)
    # A deployable of the original (the lab's compiled-PyTorch image) next to the exported ones; imports torch, so only
    # when a torch variant is served. Sources that load without unpickling only (see serving_refusal).
    servable = True

    def serving_requirements(self, artifact: Artifact) -> tuple[str, ...]:
        kind = artifact.ref.kind if artifact.ref else ""
        return (*self.requirements, "numpy") + (("transformers", "safetensors", "tokenizers") if kind == "hf_encoder" else ())

    def serving_refusal(self, artifact: Artifact) -> str | None:
        ref = artifact.ref
        if ref is None or ref.trust_pickle or ref.kind == "pickle":
            return "its source is a pickle (a server never unpickles): serve its ONNX variant or export it first"
        if ref.kind not in ("hf_encoder", "torchscript", "exported_program", "state_dict"):
            return f"a torch source of kind {ref.kind} cannot be packaged"
        return None

    def available(self) -> tuple[bool, str]:
        try:
            import torch  # noqa: F401
        except ImportError:
            return False, "torch is not installed (pip install servopt[torch])"
        return True, ""

    def extra_seconds(self, options: dict) -> float:
        """An inductor compile per input shape: MobileNetV2 on 2 AVX2 cores measured in 47-54 s with two compiles,
        against about 10 s for an eager variant."""
        return 35.0 if options.get("compile") else 0.0

    def isa_cap_env(self, level: Isa) -> dict[str, str] | None:
        """ATen's vectorized kernels honour ATEN_CPU_CAPABILITY (read back as ``cpu_capability``); oneDNN's
        convolutions and matrix products honour ONEDNN_MAX_CPU_ISA."""
        if level not in ONEDNN_ISA:
            return None
        return {"ATEN_CPU_CAPABILITY": "avx2" if level == Isa.AVX2 else "avx512", "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[level]}

    def open(self, artifact: Artifact, options: TorchOptions) -> Session:
        return TorchSession(artifact, options)


@register_runtime
class TorchCudaRuntime(TorchRuntime):
    name = "torch-cuda"
    device = Device.GPU

    def available(self) -> tuple[bool, str]:
        ok, why = super().available()
        if not ok:
            return ok, why
        import torch

        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device (this torch build is CPU-only or no GPU is present)"
        return True, ""

    def open(self, artifact: Artifact, options: TorchOptions) -> Session:
        return TorchSession(artifact, options.model_copy(update={"device": "cuda"}))
