"""How vCPUs sit on physical cores, here and on the target's instance: what each scaling point measured (a core, or a
core's second thread), and what a vCPU of the instance adds.

A 2-vCPU cloud VM is often one physical core's two hyperthreads, and an 8-vCPU instance (``c6a.2xlarge``) is 4 cores ×
2 threads. Read as cores, the 1 → 2 step of such a VM measures SMT (or a neighbour), and a law fitted to it extrapolates
that step to every added vCPU: on an AVX2 Zen 3 VM two single-thread ORT instances ran 1.46× one, and Amdahl's fit
projected 2.2× one vCPU for 8 (issue 42). So the projection counts physical cores and the threads on them apart:

- the host's reading (``read_host``): its sibling lists (``machine.read_topology``) say which points add a core and
  which a core's second thread; where they say "one thread per core" but two single-thread instances ran like a core's
  two threads (1.15–1.75×: ``CONTENDED_BELOW``, ``HT_BELOW``; 1.2–1.6× one is SMT's usual range, about 1.9× a core's),
  a 2-vCPU host is read as one core's two threads — a hypervisor need not tell the guest which vCPUs share a core;
- the law (``CoreLaw``): Gunther's USL across physical cores (λ per core, σ, κ) × the SMT factor of a core's second
  thread. Each is measured where the host has the points, else an assumption with its range (``SMT``, ``CORES``),
  stated with where the figures come from; the projection's band takes each assumption's pessimistic end for its low
  end and its optimistic end for its high end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from servopt.contracts import Topology

# two single-thread instances under this × one: a core's two threads (SMT usually adds 20-60 %), not two cores (about 1.9×)
HT_BELOW = 1.75
# under 1.15×: two instances gained less than a second thread usually adds (1.2-1.6×, the range): a neighbour, a
# stall, or a runtime not keeping to its one thread (two OpenVINO instances ran 0.84-0.95× one on the Zen 3 VM, and
# 0.98-0.99× on this Zen 4 while others shared it): neither reading fits, and the step says nothing of the target
CONTENDED_BELOW = 1.15


@dataclass(frozen=True)
class Assumed:
    """A factor the host could not measure: its range and central value, and where they come from."""

    pessimistic: float  # the value at the band's low throughput end
    central: float
    optimistic: float
    source: str

    def words(self, what: str) -> str:
        return f"{what} assumed {self.central:g} ({self.pessimistic:g}–{self.optimistic:g}: {self.source})"


# A core's second thread, where the host has none to measure it on: throughput of two single-thread instances on one
# core over one. Pessimistic end 1.0: kernels that fill a core's vector units gain nothing from its sibling (ONNX
# Runtime's default intra-op pool takes the physical cores only; DeepSparse uses only physical cores). Intel's
# "Hyper-Thread Tuning Guide for End to End Video AI Workload" (2023) measured about 10 % from hyperthreads on a Xeon;
# this project's AVX2 Zen 3 VM ran two single-thread ORT instances 1.46–1.59× one where its second vCPU behaved as a
# hyperthread (issue 42): the optimistic end.
SMT = Assumed(pessimistic=1.0, central=1.2, optimistic=1.6, source="ORT's and DeepSparse's defaults count physical cores only; about "
              "1.1 in Intel's hyper-thread tuning guide for video AI (2023); 1.46–1.59 measured on an AVX2 Zen 3 VM")
# Contention across physical cores (the USL's σ), where the host has one core: two instances on two cores of a quiet
# machine ran 1.90–1.99× one in this project (σ 0.007 image and 0.037 text on a Xeon, docs/targets.md; 1.97× ORT on
# the Zen 3 VM, FIELD-NOTES): σ up to 0.1 (1.82×) for the pessimistic end.
CORES = Assumed(pessimistic=0.1, central=0.04, optimistic=0.0, source="two instances on two quiet cores ran 1.90–1.99× one in this "
                "project's measurements (σ 0.007–0.04)")


@dataclass(frozen=True)
class HostReading:
    """What the scaling points measured: the first ``cores`` instances each on a core of its own, the next ones on
    those cores' second threads (the scheduler fills idle cores first), ``threads`` at most per core."""

    cores: int
    threads: int
    kind: Literal["cores", "siblings", "smt-like", "contended", "unknown"]
    ratio: float | None  # two instances over one (medians), where both were measured
    words: str

    def layout(self, vcpus: int) -> tuple[int, int]:
        """(cores, vCPUs) ``vcpus`` instances ran on here."""
        vcpus = min(vcpus, self.cores * self.threads)
        return min(vcpus, self.cores), vcpus


def read_host(topology: Topology | None, ratio: float | None, cpus: int, run: float | None = None) -> HostReading:
    """The host's reading from its sibling lists and, where they say one thread per core, from how two single-thread
    instances scaled (``ratio``: two over one; ``run``: the highest any variant of the run showed, which says what the
    second vCPU can give: a variant under it contends across two cores, it does not make them one)."""
    r = f"two instances ran {ratio:.2f}× one" if ratio is not None else "one point"
    if topology is not None and topology.threads_per_core >= 2:
        return HostReading(topology.cores, 2, "siblings", ratio, f"{topology.cores} core(s) × 2 threads (sysfs sibling "
                           f"lists): the points past {topology.cores} add a core's second thread; {r}")
    cores = topology.cores if topology is not None else cpus
    unknown = "" if topology is not None and topology.source == "sysfs" else " (no topology recorded: read as cores)"
    if ratio is not None and ratio < CONTENDED_BELOW:
        return HostReading(cores, 1, "contended", ratio, f"{cores} cores{unknown}, but {r}: a neighbour or a runtime not "
                           "keeping to its one thread; read as cores, the projection held at the figure measured")
    if ratio is not None and ratio < HT_BELOW and cpus == 2 and run is not None and run >= HT_BELOW:
        return HostReading(cores, 1, "cores", ratio, f"{cores} cores × 1 thread{unknown}; {r}, but another variant of the "
                           f"run ran {run:.2f}× one on the same vCPUs (a core's about 1.9×; SMT's {CONTENDED_BELOW:g}–"
                           f"{HT_BELOW:g}×): two cores this variant contends across")
    if ratio is not None and ratio < HT_BELOW and cpus == 2:
        return HostReading(1, 2, "smt-like", ratio, f"{r} (SMT's {CONTENDED_BELOW:g}–{HT_BELOW:g}×, a core's about 1.9×): read as one "
                           "core's two threads, though the sibling lists say one thread per core (a hypervisor need "
                           "not say which vCPUs share a core)")
    return HostReading(cores, 1, "cores" if not unknown else "unknown", ratio, f"{cores} cores × 1 thread{unknown}; {r}")


def topology_reading(topology: Topology | None, cpus: int) -> HostReading:
    """The host read from its sibling lists alone (no measured step): what a law fitted on one vCPU knows of the
    second (``scaling.check``)."""
    return read_host(topology, None, cpus)


@dataclass(frozen=True)
class CoreLaw:
    """Throughput on ``cores`` physical cores running ``vcpus`` single-thread instances: the USL across cores, times
    ``1 + (smt − 1) × (vcpus − cores) / cores`` for the second threads."""

    lam: float  # per core
    sigma: float
    kappa: float
    smt: float

    def cores_only(self, n: float) -> float:
        return self.lam * n / (1 + self.sigma * (n - 1) + self.kappa * n * (n - 1))

    def __call__(self, cores: int, vcpus: int) -> float:
        extra = max(0, min(vcpus, 2 * cores) - cores)
        return self.cores_only(cores) * (1 + (self.smt - 1) * extra / cores)

    def effective(self, cores: int, vcpus: int) -> float:
        """Core-equivalents ``vcpus`` threads on ``cores`` cores give one request's threads (Amdahl's N)."""
        return cores + (self.smt - 1) * max(0, min(vcpus, 2 * cores) - cores)
