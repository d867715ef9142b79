"""PyTorch: eager under ``inference_mode``, channels_last, torch.compile, dynamic INT8.

The artifact is a reference to the source model (``LoadedModel.ref``); the
transforms are applied when the session opens, so compile time lands in the
cold-start figure where it belongs.
"""

from __future__ import annotations

import time

import numpy as np

from servopt.errors import UserError
from servopt.runtimes.base import Runtime, Session, register_runtime

# glibc returns large tensor buffers to the OS after every forward unless told not to; set in a process's
# environment before it starts, this took eager batch-32 from 26 to 91 img/s here (FIELD-NOTES), training too.
MALLOC_TUNED_ENV = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"}


class TorchSession(Session):
    def __init__(self, artifact: dict, options: dict) -> None:
        import torch

        from servopt.models.sources import LoadedModel

        self.torch = torch
        self.options = options
        if options.get("threads"):
            torch.set_num_threads(int(options["threads"]))
        model = LoadedModel.from_ref(artifact["ref"])
        self.input_names = model.spec.input_names
        self.device = options.get("device", "cpu")
        module = model.torch_module()
        if options.get("quantize_dynamic"):
            module = torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)
        self.channels_last = bool(options.get("channels_last"))
        if self.channels_last:
            module = module.to(memory_format=torch.channels_last)
        self.dtype = torch.float16 if options.get("fp16") else None
        if self.device != "cpu":
            module = module.to(self.device)
        if self.dtype is not None:
            module = module.to(self.dtype)
        self.compile_s = 0.0
        if options.get("compile"):
            if options.get("freezing"):
                import torch._inductor.config as inductor_config

                inductor_config.freezing = True
            mode = None if options["compile"] == "default" else options["compile"]
            module = torch.compile(module, mode=mode)
        self.module = module

    def prepare(self, feed: dict[str, np.ndarray]):
        torch = self.torch
        tensors = []
        for name in self.input_names:
            t = torch.from_numpy(np.ascontiguousarray(feed[name]))
            if self.channels_last and t.dim() == 4:
                t = t.contiguous(memory_format=torch.channels_last)
            if self.device != "cpu":
                t = t.to(self.device)
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            tensors.append(t)
        return tensors

    def run_prepared(self, prepared):
        with self.torch.inference_mode():
            out = self.module(*prepared)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if self.device != "cpu":
            self.torch.cuda.synchronize()
        return out

    def to_numpy(self, output) -> np.ndarray:
        return output.float().cpu().numpy()

    def warm_compile(self, feed: dict[str, np.ndarray]) -> float:
        """Run once so torch.compile compiles; returns seconds spent (reported as cold start)."""
        start = time.perf_counter()
        self.run(feed)
        return time.perf_counter() - start

    def info(self) -> dict:
        torch = self.torch
        return {
            "runtime": "torch",
            "provider_requested": self.options.get("device", "cpu"),
            "provider_actual": self.device,
            "provider_fallback": False,
            "threads": torch.get_num_threads(),
            "mode": f"compile:{self.options['compile']}" if self.options.get("compile") else "eager+inference_mode",
            "channels_last": self.channels_last,
        }


@register_runtime
class TorchRuntime(Runtime):
    name = "torch"
    artifact_formats = ("torch",)

    def available(self) -> tuple[bool, str]:
        try:
            import torch  # noqa: F401
        except ImportError:
            return False, "torch is not installed (pip install servopt[torch])"
        return True, ""

    def open(self, artifact: dict, options: dict) -> Session:
        ok, why = self.available()
        if not ok:
            raise UserError(why, fix="pip install 'servopt[torch]'")
        return TorchSession(artifact, options)


@register_runtime
class TorchCudaRuntime(TorchRuntime):
    name = "torch-cuda"
    needs_gpu = True

    def available(self) -> tuple[bool, str]:
        ok, why = super().available()
        if not ok:
            return ok, why
        import torch

        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device (this torch build is CPU-only or no GPU is present)"
        return True, ""

    def open(self, artifact: dict, options: dict) -> Session:
        return super().open(artifact, {"device": "cuda", **options})
