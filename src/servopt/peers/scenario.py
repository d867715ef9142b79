"""A scenario: one workload and its figure, read from a measuring process's ``Measured``.

Every answer (the pick's and the peers') is measured by the same ``MeasureJob``: verified on the run's evaluation data
against the original's outputs with the family's ``judge`` (the quality check, the same for every scenario), then
timed by the protocol. A scenario names the figure it compares, which way is better, and the protocol settings its
workload needs; one file in ``scenarios/`` each. The served scenarios (``scenarios/served.py``) read a served round's
load steps instead, measured with the pick and each serving peer behind their servers.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from servopt.bench.protocol import Protocol
from servopt.contracts import Measured
from servopt.registry import Registry


class Scenario:
    name: ClassVar[str]
    metric: ClassVar[str]  # the figure's name in PeerRatio
    better: ClassVar[Literal["lower", "higher"]]
    description: ClassVar[str] = ""
    label: ClassVar[str] = ""  # the report's and the terminal's column heading for the figure (default: the metric)

    def figure(self, m: Measured) -> float | None:
        """The figure of one measurement, None when it has none."""
        raise NotImplementedError

    def protocol(self, base: Protocol) -> Protocol:
        """The run's protocol with what this workload needs (default: as the run measured)."""
        return base


SCENARIOS: Registry[Scenario] = Registry("scenario", "servopt.peers.scenarios")


def register_scenario(cls: type[Scenario]) -> type[Scenario]:
    return SCENARIOS.register(cls)
