"""Facts of the machine a figure is measured on: CPU model and instruction-set features, cores, GPU.

Read at measurement time and stored in every record's ``environment``; nothing
that decides or reports asks the machine it happens to run on (a report
rendered on a laptop describes the server that measured). ``CpuFeatures`` is
a value, so tests inject a feature set instead of depending on this machine.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Literal

from servopt.contracts import Environment, SessionInfo, Topology

# The /proc/cpuinfo flags (x86) and Features (ARM) that change which variant wins.
KNOWN_FEATURES = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx_vnni_int8", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_int8", "amx_bf16", "amx_fp16",  # x86
    "asimd", "asimddp", "asimdhp", "fphp", "sve", "sve2", "i8mm", "bf16",  # ARM (dot product, fp16 arithmetic, int8 matmul)
)
BASE_LIBRARIES = ("numpy", "onnx", "onnxruntime")
# glibc returns large tensor buffers to the OS after every forward unless told otherwise, and PyTorch on CPU loses much of
# its batch throughput to it (measured 26 → 91 img/s on MobileNetV2): a no-install stand-in for jemalloc/tcmalloc.
MALLOC_TUNED_ENV = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"}


class Isa(StrEnum):
    """The x86 instruction-set ladder servopt measures against, poorest first: the one declaration of it. A target
    names one; a machine's is ``CpuFeatures.level``; runtimes map it to their own caps (``Runtime.isa_cap_env``)."""

    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_VNNI = "avx512_vnni"
    AMX = "amx"

    @property
    def rank(self) -> int:
        return list(Isa).index(self)

    # Every comparison by rank: str's own (alphabetical) ones would otherwise answer for the ones not defined here.
    def __lt__(self, other: object) -> bool:
        return self.rank < Isa(other).rank

    def __le__(self, other: object) -> bool:
        return self.rank <= Isa(other).rank

    def __gt__(self, other: object) -> bool:
        return self.rank > Isa(other).rank

    def __ge__(self, other: object) -> bool:
        return self.rank >= Isa(other).rank


def richer(level: Isa | str | None, than: Isa | str | None) -> bool:
    """Whether ``level`` is richer than ``than`` on the ladder; a level off the ladder (ARM, baseline x86) never is."""
    try:
        return level is not None and than is not None and Isa(level) > Isa(than)
    except ValueError:
        return False


# The INT8 product a model runs on x86, by activations × weights: "u8s8" (8-bit s8 weights: summed in saturating int16
# pairs without VNNI), "u8s8-7bit" (7-bit weights: no pair can overflow), "u8u8" (16-bit products), "s8s8" (signed
# activations: fast in ONNX Runtime only with AVX-VNNI-INT8 or ARM dot products). A quantizer says which its model
# is (``Pass.int8_kernel``), a runtime what it runs of it (``Runtime.int8_kernel``), the CPU what it computes fast
# and right (``CpuFeatures.int8_trouble``).
Int8Kernel = Literal["u8s8", "u8s8-7bit", "u8u8", "s8s8"]


class Device(StrEnum):
    """Where a target runs, and where a runtime computes: what may be measured on which machine is decided here."""

    CPU = "cpu"
    GPU = "gpu"
    EDGE = "edge"

    @property
    def computes_on(self) -> Device:
        """The device a variant for this target computes on (an edge target takes CPU variants)."""
        return Device.GPU if self is Device.GPU else Device.CPU

    def measurable_on(self, env: Environment | None) -> bool:
        """Whether figures taken on ``env`` count for this device: a CPU target's on any CPU (verdicts say which), a GPU
        target's only on a machine with a GPU, an edge device's never (measure on the device itself)."""
        if self is Device.CPU:
            return True
        if self is Device.GPU:
            return bool(env and env.gpu)
        return False

    def why_not_measurable(self) -> str:
        return ("measure on the device with `servopt bench`" if self is Device.EDGE
                else "not measured: these figures come from a machine without a GPU")


@dataclass(frozen=True)
class CpuFeatures:
    """What the CPU can do fast, from its feature flags. ``level`` is the richest instruction set of the ladder
    servopt measures against (targets name one: ``avx2`` < ``avx512`` < ``avx512_vnni`` < ``amx``)."""

    flags: frozenset[str]

    @property
    def int8_dot(self) -> bool:
        """8-bit dot-product instructions (VNNI on x86, SDOT/UDOT on ARM): INT8 with signed activations is fast."""
        return bool(self.flags & {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"})

    @property
    def int8_signed(self) -> bool:
        """Fast INT8 with signed activations (S8S8) in ONNX Runtime. MLAS dispatches its S8S8 kernels to VNNI only with
        AVX-VNNI-INT8 on x86 (``platform.cpp``: AVX512-VNNI and AMX speed up U8S8 alone), and to SDOT/SMMLA on ARM.
        Measured on a Zen 4 EPYC with AVX512-VNNI: S8S8 QOperator 27 ms vs U8S8 1.9 ms on the demo MobileNetV2."""
        return bool(self.flags & {"avx_vnni_int8", "asimddp", "i8mm"})

    @property
    def int8_saturates(self) -> bool:
        """x86 without 8-bit dot products: ONNX Runtime computes U8S8 with ``vpmaddubsw``, whose 16-bit intermediate
        saturates when two u8×s8 products add past 32767 (ORT's docs; ``session.x64quantprecision``). Weights in 7 bits
        (``reduce_range``, NNCF's overflow fix) cannot overflow; U8U8 does not either, more slowly."""
        x86 = bool(self.flags & {"avx2", "avx512f"})
        return x86 and not self.int8_dot

    def without_dot_products(self) -> CpuFeatures:
        """This CPU as a target without 8-bit dot products sees INT8 (an AVX2 EPYC, for weights built on a VNNI Xeon)."""
        return CpuFeatures(self.flags - {"avx512_vnni", "avx_vnni", "avx_vnni_int8", "amx_int8"})

    def int8_trouble(self, kernel: Int8Kernel | None) -> str | None:
        """What goes wrong with ``kernel`` on this CPU, or None: full-range U8S8 saturates without VNNI (static U8S8 lost
        5.43 points on the demo on an AVX2 Zen 3, where 7-bit weights lost 0.54); S8S8 runs slower than fp32 without
        fast signed kernels (QDQ S8S8 at half ORT fp32's speed there)."""
        if kernel == "u8s8" and self.int8_saturates:
            return "its 8-bit U8S8 sums saturate in int16 without VNNI"
        if kernel == "s8s8" and not self.int8_signed and bool(self.flags & {"avx2", "avx512f"}):
            return "signed INT8 activations run slowly without AVX-VNNI-INT8"
        return None

    @property
    def bf16(self) -> bool:
        return bool(self.flags & {"avx512_bf16", "amx_bf16", "bf16"})

    @property
    def fp16(self) -> bool:
        """Native fp16 arithmetic (not just conversion, which F16C gives)."""
        return bool(self.flags & {"avx512_fp16", "amx_fp16", "asimdhp", "fphp"})

    @property
    def amx(self) -> bool:
        return bool(self.flags & {"amx_int8", "amx_bf16"})

    @property
    def level(self) -> Isa | str:
        """The richest rung of the ``Isa`` ladder this CPU reaches; ``arm`` or ``baseline`` off the ladder."""
        if self.amx:
            return Isa.AMX
        if "avx512_vnni" in self.flags:
            return Isa.AVX512_VNNI
        if "avx512f" in self.flags:
            return Isa.AVX512
        if "avx2" in self.flags:
            return Isa.AVX2
        return "arm" if self.flags & {"asimd", "sve"} else "baseline"

    def describe(self) -> str:
        parts = [str(self.level)]
        parts += [name for name, on in (("VNNI/dot-product INT8", self.int8_dot),
                                        ("signed INT8", self.int8_signed), ("bf16", self.bf16), ("fp16", self.fp16),
                                        ("AMX", self.amx)) if on]
        return ", ".join(parts)


@lru_cache(maxsize=1)
def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.readlines()
    except OSError:
        return []


@lru_cache(maxsize=1)
def cpu_model() -> str:
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# The x86 features each rung of the ladder adds: reading a CPU as if it stopped at a rung drops every later rung's.
RUNG_FEATURES = {
    Isa.AVX2: frozenset({"avx2", "fma", "f16c"}),
    Isa.AVX512: frozenset({"avx512f", "avx512bw", "avx512vl"}),
    Isa.AVX512_VNNI: frozenset({"avx512_vnni", "avx_vnni", "avx_vnni_int8", "avx512_bf16", "avx512_fp16"}),
    Isa.AMX: frozenset({"amx_tile", "amx_int8", "amx_bf16", "amx_fp16"}),
}
# SERVOPT_CPU_READ_AS=avx2: servopt reads this CPU as one that stops at that rung (CI runs the tests whose answer
# depends on the CPU that way on a VNNI/AMX machine: issue 40). Only servopt's reading changes — what it plans,
# orders, warns about —, never the kernels a runtime picks; a record says so (Environment.cpu_read_as).
READ_AS_ENV = "SERVOPT_CPU_READ_AS"


def read_as() -> Isa | None:
    value = os.environ.get(READ_AS_ENV, "").strip().lower()
    if not value:
        return None
    try:
        return Isa(value)
    except ValueError:
        from servopt.errors import UserError

        raise UserError(f"{READ_AS_ENV}={value!r} is not a rung of the instruction-set ladder",
                        fix=f"set it to one of {', '.join(i.value for i in Isa)}, or unset it") from None


def host_features() -> CpuFeatures:
    """The features /proc/cpuinfo lists, as the kernels see them (``cpu_features`` is servopt's reading of them)."""
    for line in _cpuinfo_lines():
        if line.startswith(("flags", "Features")):
            return CpuFeatures(frozenset(line.split(":", 1)[1].split()) & frozenset(KNOWN_FEATURES))
    return CpuFeatures(frozenset())


def capped_features(features: CpuFeatures, rung: Isa) -> CpuFeatures:
    """``features`` without those of the rungs above ``rung``."""
    dropped = frozenset().union(*(f for r, f in RUNG_FEATURES.items() if r > rung))
    return CpuFeatures(features.flags - dropped)


def cpu_features() -> CpuFeatures:
    """This CPU's features as servopt reads them: the host's, less the rungs above ``SERVOPT_CPU_READ_AS``."""
    rung = read_as()
    return capped_features(host_features(), rung) if rung is not None else host_features()


@lru_cache(maxsize=1)
def gpu_name() -> str | None:
    """The first NVIDIA GPU's name, or None (no driver, no device)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None
    return name


def gpu_present() -> bool:
    return gpu_name() is not None


SYSFS_CPU = Path("/sys/devices/system/cpu")


def _cpu_list(text: str) -> list[int]:
    """A sysfs CPU list (``0-3,8,10-11``) as CPU numbers."""
    out: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out += range(int(a), int(b) + 1)
        elif part:
            out.append(int(part))
    return out


def read_topology(cpus: set[int] | None = None, root: Path = SYSFS_CPU) -> Topology:
    """How the logical CPUs ``cpus`` (this process's affinity by default) sit on physical cores: from each CPU's
    ``topology/thread_siblings_list`` in sysfs — the kernel's own reading, which lscpu's "Thread(s) per core" comes from
    (no lscpu run: it is the same file, and may be absent). A CPU whose files cannot be read counts as a core of its
    own, and the source says ``unknown`` when none could be."""
    if cpus is None:
        cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    groups: dict[tuple[int, ...], list[int]] = {}
    read = 0
    for cpu in sorted(cpus):
        try:
            siblings = _cpu_list((root / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
            read += 1
        except (OSError, ValueError):
            siblings = [cpu]
        groups.setdefault(tuple(sorted(set(siblings) | {cpu})), []).append(cpu)
    cores = [sorted(g) for g in groups.values()]
    return Topology(cpus=len(cpus), cores=len(cores), threads_per_core=max((len(g) for g in cores), default=1),
                    siblings=sorted(cores), source="sysfs" if read else "unknown")


@lru_cache(maxsize=1)
def topology() -> Topology:
    """This process's ``read_topology()``, read once."""
    return read_topology()


def library_versions(names: tuple[str, ...] | list[str]) -> dict[str, str]:
    out = {}
    for lib in dict.fromkeys([*BASE_LIBRARIES, *names]):
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            continue
    return out


def node_name() -> str:
    """The node a figure is measured on: ``SERVOPT_NODE`` where a distributed sweep set it (the Ray node: simulated
    nodes share a host name), else the host name."""
    return os.environ.get("SERVOPT_NODE") or socket.gethostname()


def environment(session: SessionInfo | None = None, libraries: tuple[str, ...] | list[str] = ()) -> Environment:
    """This process's machine and libraries, plus what the session says actually ran."""
    return Environment(
        cpu=cpu_model(), cpu_flags=sorted(cpu_features().flags), cores=os.cpu_count(),
        cores_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        gpu=gpu_present(), gpu_name=gpu_name(), node=node_name(), python=platform.python_version(),
        platform=platform.platform(), libraries=library_versions(libraries),
        isa_cap=os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("ATEN_CPU_CAPABILITY"),
        runtime_env=os.environ.get("SERVOPT_RUNTIME_ENV"), session=session, cpu_read_as=read_as(), topology=topology(),
    )


def machine_label(env: Environment | None) -> str:
    """How a record names the machine it was measured on (from the record, never from this machine)."""
    if env is None:
        return "an unrecorded machine"
    return f"{env.cpu} ({env.cores} cores)"


def header(env: Environment | None = None) -> str:
    """The line every benchmark prints above its figures (a figure means nothing without the CPU it came from): the
    CPU, its cores (those this process may use when fewer), the instruction set and INT8/bf16 features that decide
    which variant wins, and an ISA cap in force. From ``env`` when given (a record's), else this machine."""
    env = env or environment()
    cores = f"{env.cores} cores" + (f" ({env.cores_usable} usable)" if env.cores_usable and env.cores_usable != env.cores else "")
    features = CpuFeatures(frozenset(env.cpu_flags)).describe() if env.cpu_flags else "flags unknown"
    topo = env.topology
    if topo is not None and topo.threads_per_core > 1:  # hyperthreads: a second instance adds SMT's share, not a core's
        cores += f" ({topo.cores} physical × {topo.threads_per_core} threads)"
    cap = f", capped at {env.isa_cap}" if env.isa_cap else ""
    read_as = f", read by servopt as {env.cpu_read_as} ({READ_AS_ENV})" if env.cpu_read_as else ""
    return f"{env.cpu}, {cores}, {features}{cap}{read_as}"
