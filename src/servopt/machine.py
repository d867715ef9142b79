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
from enum import StrEnum
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from servopt.contracts import Environment, SessionInfo, Topology
from servopt.cpu import CpuFeatures, Isa, capped_features

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


def cpuid_features() -> dict[str, bool]:
    """What CPUID itself answers, as numpy reads it (the same instruction the kernels dispatch on): under qemu-user,
    whose /proc/cpuinfo stays the host's, this is the emulated CPU (``benchmarks/avx2_cpu.sh``)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as cpuid
    except ImportError:  # numpy < 2
        return {}
    return {k: bool(v) for k, v in cpuid.items()}


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


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, a container's cpuset), not the host's count.
    Everything that sizes work by cores asks this: a server given 2 of a host's 64 CPUs that split by
    ``os.cpu_count()`` would run 2 instances of 32 threads each on 2 CPUs (issue 42)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux: no affinity masks to read
        return os.cpu_count() or 1


def node_name() -> str:
    """The node a figure is measured on: ``SERVOPT_NODE`` where a distributed sweep set it (the Ray node: simulated
    nodes share a host name), else the host name."""
    return os.environ.get("SERVOPT_NODE") or socket.gethostname()


def environment(session: SessionInfo | None = None, libraries: tuple[str, ...] | list[str] = ()) -> Environment:
    """This process's machine and libraries, plus what the session says actually ran."""
    return Environment(
        cpu=cpu_model(), cpu_flags=sorted(cpu_features().flags), cores=os.cpu_count(),
        cores_usable=usable_cores(),
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
