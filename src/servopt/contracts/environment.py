"""The machine a measurement ran on: its vCPUs' topology and the environment snapshot every record carries."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from servopt.contracts.artifacts import SessionInfo
from servopt.contracts.base import Contract
from servopt.cpu import CpuFeatures, Isa


class Topology(Contract):
    """How the logical CPUs a process may use sit on physical cores (sysfs: each CPU's ``topology/thread_siblings_list``,
    what lscpu's "Thread(s) per core" is read from). A 2-vCPU cloud VM is often one core's two hyperthreads: a second
    instance there adds what SMT adds, not a core (``optimize.layout``)."""

    cpus: int  # logical CPUs usable here (the affinity mask)
    cores: int  # the physical cores they sit on
    threads_per_core: int  # the most usable logical CPUs one core holds
    siblings: list[list[int]] = Field(default_factory=list)  # the usable logical CPUs grouped by core
    source: Literal["sysfs", "unknown"] = "sysfs"  # unknown: no sysfs (not Linux): each CPU read as a core


class Environment(Contract):
    cpu: str
    cpu_flags: list[str] = Field(default_factory=list)
    cores: int | None = None
    cores_usable: int | None = None
    gpu: bool = False
    gpu_name: str | None = None
    node: str | None = None  # the node that measured: SERVOPT_NODE (a Ray node of a distributed sweep) or the host name
    python: str = ""
    platform: str = ""
    libraries: dict[str, str] = Field(default_factory=dict)
    isa_cap: str | None = None  # an instruction-set cap the measurement ran under (oneDNN / ATen)
    # servopt read the CPU as one stopping at this rung (SERVOPT_CPU_READ_AS): cpu_flags lack the richer rungs' features,
    # which the runtimes' kernels still used
    cpu_read_as: str | None = None

    @property
    def isa(self) -> Isa | str:
        """The richest rung of the instruction-set ladder the measuring CPU reached (``CpuFeatures.level``), from its
        recorded flags: what a figure was measured with, never this machine's."""
        return CpuFeatures(frozenset(self.cpu_flags)).level
    runtime_env: str | None = None  # the runtime's own Python environment it ran in (servopt.envs: name-key)
    session: SessionInfo | None = None
    topology: Topology | None = None  # cores × threads of the CPUs it ran on (None: a record of an older servopt)
