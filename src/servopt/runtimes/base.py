"""The runtime interface and registry: a new backend is one file that registers itself.

A ``Runtime`` owns every fact about itself: the artifact formats it opens, its
options (a pydantic model, validated once, like a pass's ``Params``), which
option sets its threads, how a server should set it up, its Triton platform
name, the pip packages a serving install needs for it, the libraries whose
versions a record carries, and how to profile it. Nothing outside ``runtimes/``
branches on a runtime's name. ``open`` returns a ``Session``, which splits
input preparation from execution so the benchmark times only execution, and
says what actually ran (``info``), read back from the framework.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from servopt.contracts import Artifact, OpProfile, OpTime, SessionInfo
from servopt.cpu import Int8Kernel, Isa
from servopt.envs import EnvSpec
from servopt.errors import UserError
from servopt.machine import Device, usable_cores
from servopt.registry import Registry


class RuntimeOptions(BaseModel):
    """A runtime's options; unknown names are refused (a typo would otherwise be measured as the default)."""

    model_config = ConfigDict(extra="forbid")


class Session(ABC):
    """A loaded model ready to run. ``run`` returns the first output as NumPy."""

    input_names: list[str]

    def prepare(self, feed: dict[str, np.ndarray]) -> Any:
        """Convert inputs to the runtime's native form (done before timing)."""
        return feed

    @abstractmethod
    def run_prepared(self, prepared: Any) -> Any:
        """Execute on prepared inputs; the benchmark times exactly this call."""

    def to_numpy(self, output: Any) -> np.ndarray:
        return np.asarray(output)

    def run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        return self.to_numpy(self.run_prepared(self.prepare(feed)))

    def warm_up(self, feed: dict[str, np.ndarray]) -> float:
        """Run once before anything is timed; returns the seconds a just-in-time compiler spent (0 for others)."""
        self.run(feed)
        return 0.0

    @abstractmethod
    def info(self) -> SessionInfo:
        """What actually ran: provider/device, precision, threads, settings. Reported with every figure."""

    def profile(self, feeds: list[dict[str, np.ndarray]], runs: int, top: int) -> OpProfile:
        """Where the time goes, op by op, over ``runs`` single-sample calls."""
        raise UserError(f"runtime {self.info().runtime} has no op-level profiler", fix="profile a variant on another runtime")


class Runtime(ABC):
    name: ClassVar[str]
    artifact_formats: ClassVar[tuple[str, ...]]  # which artifact formats it opens
    Options: ClassVar[type[RuntimeOptions]] = RuntimeOptions
    thread_option: ClassVar[str | None] = None  # the option that sets intra-op threads
    device: ClassVar[Device] = Device.CPU  # where it computes: a GPU runtime serves only GPU targets
    servable: ClassVar[bool] = False  # may `servopt serve` run it (never a pickle: see serving_refusal)
    triton_platform: ClassVar[str] = "custom"  # Triton's name for the backend, in model metadata and config
    requirements: ClassVar[tuple[str, ...]] = ()  # pip distributions a serving install needs for this runtime
    libraries: ClassVar[tuple[str, ...]] = ()  # distributions whose versions each record of it carries

    def serving_requirements(self, artifact: Artifact) -> tuple[str, ...]:
        """What a serving install needs to open ``artifact`` with this runtime (the format may add to ``requirements``)."""
        return self.requirements

    def serving_refusal(self, artifact: Artifact) -> str | None:
        """Why the server must not open ``artifact`` (None: it may)."""
        return None

    def parse_options(self, options: dict | RuntimeOptions | None) -> RuntimeOptions:
        """Validate once; the error names the option and lists the known ones."""
        if isinstance(options, self.Options):
            return options
        raw = options.model_dump(exclude_unset=True) if isinstance(options, BaseModel) else dict(options or {})
        try:
            return self.Options(**raw)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise UserError(f"bad option for runtime {self.name}: {field}: {first['msg']}",
                            fix=f"{self.name} takes: {', '.join(self.Options.model_fields) or 'no options'}") from e

    def with_threads(self, options: RuntimeOptions, threads: int | None) -> RuntimeOptions:
        """``options`` with the intra-op thread count set (no-op for a runtime without a thread option)."""
        if threads is None or self.thread_option is None:
            return options
        return options.model_copy(update={self.thread_option: threads})

    def environment(self) -> EnvSpec | None:
        """A Python environment of its own (``servopt.envs``) when its build cannot share one with the others
        (``onnxruntime-openvino`` and ``onnxruntime-gpu`` overwrite the plain ``onnxruntime``); None: this one."""
        return None

    def extra_seconds(self, options: dict) -> float:
        """Seconds its ``options`` add to a variant's measurement beyond an average one (a compile), before a run on
        this CPU has timed it: what a time budget plans with."""
        return 0.0

    def isa_cap_env(self, level: Isa) -> dict[str, str] | None:
        """Environment variables that hold this runtime to an instruction-set ``level`` (``avx2`` … ``amx``), or None
        where it cannot be held (it then measures with whatever the CPU has, and verdicts say so)."""
        return None

    def int8_kernel(self, quantized: Int8Kernel, options: dict) -> Int8Kernel | None:
        """The INT8 product its kernels run with ``options`` for a model quantized as ``quantized``; None where its
        kernels are its own and not known (OpenVINO's oneDNN): the race then expects nothing of it, and a model
        whose weights can overflow without VNNI keeps that risk (``decide``)."""
        return None

    def serving_options(self, options: RuntimeOptions) -> RuntimeOptions:
        """How a server should run it, given the variant's options (the event loop shares the cores)."""
        return options

    @abstractmethod
    def open(self, artifact: Artifact, options: Any) -> Session: ...

    def available(self) -> tuple[bool, str]:
        """Whether this machine can run it, and why not."""
        return True, ""


# How the runtimes keep several sessions of one process to their threads; a figure measured with several instances (the
# scaling curve, a served capacity) has it in its cache key, so one taken before a change is measured again. 2: OpenVINO
# pins only a session that takes every core, torch sets its thread count in each calling thread (issue 41).
INSTANCE_THREADING = 2


def takes_every_core(threads: int | None) -> bool:
    """Whether a session of ``threads`` (None: the runtime's default, every core) leaves no core of this process to
    another instance: only such a session may pin its threads to cores. A runtime that pins a session of fewer threads
    pins it to the first cores, where the next instance is pinned too (OpenVINO: ``openvino_runtime``)."""
    return not threads or threads >= usable_cores()


# oneDNN's names for the levels a target may name (ONEDNN_MAX_CPU_ISA): OpenVINO's and torch's CPU kernels use it.
ONEDNN_ISA = {Isa.AVX2: "AVX2", Isa.AVX512: "AVX512_CORE", Isa.AVX512_VNNI: "AVX512_CORE_VNNI", Isa.AMX: "AVX512_CORE_AMX"}

RUNTIMES: Registry[Runtime] = Registry("runtime", "servopt.runtimes")
register_runtime = RUNTIMES.register
get_runtime = RUNTIMES.get


def open_session(artifact: Artifact | dict, runtime: str, options: dict | RuntimeOptions | None = None) -> Session:
    rt = get_runtime(runtime)
    artifact = artifact if isinstance(artifact, Artifact) else Artifact.model_validate(artifact)
    if artifact.format not in rt.artifact_formats:
        raise UserError(f"runtime {runtime} cannot open a {artifact.format} artifact", fix=f"it opens {rt.artifact_formats}")
    ok, why = rt.available()
    if not ok:
        raise UserError(why, fix=f"install what runtime {runtime} needs, or measure another runtime")
    return rt.open(artifact, rt.parse_options(options))


def all_libraries() -> list[str]:
    """Every registered runtime's libraries: what an environment snapshot records."""
    RUNTIMES.load()
    return list(dict.fromkeys(lib for cls in RUNTIMES.classes.values() for lib in cls.libraries))


def top_ops(times_us: dict[str, float], calls: dict[str, int], runs: int, top: int, profiler: str) -> OpProfile:
    """Aggregate per-op kernel times (µs over ``runs`` calls) into the shares a report shows."""
    total = sum(times_us.values()) or 1.0
    ops = sorted(times_us.items(), key=lambda kv: -kv[1])
    return OpProfile(profiler=profiler, total_ms_per_run=total / runs / 1000, ops=[
        OpTime(op=op, ms_per_run=t / runs / 1000, share=t / total, calls_per_run=calls[op] / runs) for op, t in ops[:top]])
