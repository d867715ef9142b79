"""Single requests: the median time of one sample, one call at a time (an interactive endpoint at low load)."""

from __future__ import annotations

from servopt.contracts import Measured
from servopt.peers.scenario import Scenario, register_scenario


@register_scenario
class Single(Scenario):
    name = "single"
    metric = "p50_ms"
    better = "lower"
    description = "one sample per call, one call at a time: the median latency"
    label = "p50 (single request)"

    def figure(self, m: Measured) -> float | None:
        return m.latency_ms.p50 if m.latency_ms else None
