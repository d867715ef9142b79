"""Offline batches: samples per second at the run's batch size (a batch job, an indexer)."""

from __future__ import annotations

from servopt.contracts import Measured
from servopt.peers.scenario import Scenario, register_scenario


@register_scenario
class Offline(Scenario):
    name = "offline"
    metric = "throughput_ips"
    better = "higher"
    label = "throughput (offline batches)"
    description = "batches of the run's batch size back to back: samples per second"

    def figure(self, m: Measured) -> float | None:
        return m.throughput_ips.batch if m.throughput_ips and m.throughput_ips.batch else None
