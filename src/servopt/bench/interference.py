"""How much CPU OTHER processes used while we were timing.

On a shared machine the same variant measured twice can differ by 2×; the
tool must say when its own figures are suspect. ``/proc/stat`` gives the whole
machine's busy time (steal included), ``os.times`` our own; the difference is
everyone else (the readers: ``bench.cputime``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from servopt.bench.cputime import machine_busy_s, own_cpu_s
from servopt.contracts import CpuReport

# Past this share of the machine used by others during a timed phase, the figure is flagged.
DEFAULT_THRESHOLD = 0.10


@dataclass
class CpuMonitor:
    """Context manager: ``with CpuMonitor() as m: ...; m.report``."""

    threshold: float = DEFAULT_THRESHOLD
    report: CpuReport | None = None

    def __enter__(self) -> CpuMonitor:
        self._busy0, self._steal0 = machine_busy_s()
        self._own0 = own_cpu_s()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        busy1, steal1 = machine_busy_s()
        own = own_cpu_s() - self._own0
        ncpu = os.cpu_count() or 1
        other = max(0.0, (busy1 - self._busy0) - own)
        share = other / (wall * ncpu) if wall > 0 else 0.0
        self.report = CpuReport(
            wall_s=round(wall, 3), own_cpu_s=round(own, 3), other_cpu_s=round(other, 3), steal_s=round(steal1 - self._steal0, 3),
            other_share=round(share, 4),  # fraction of the whole machine used by others
            flagged=bool(share > self.threshold),
        )
