"""The typed contracts that cross module and process boundaries.

A measurement job's inputs and outputs, the artifact a pass builds, what a
runtime says actually ran, and the record ``results.jsonl`` stores are pydantic
models, so a field is declared once, validated where it enters, and the JSON
Schema in ``schema/result.schema.json`` is generated from ``Record`` itself
(``python -m servopt.results``): the documented schema cannot drift from the code.

One module per kind of contract (``base``, ``artifacts``, ``environment``, ``quality``, ``record``, ``remeasure``,
``instance``); every name is importable from ``servopt.contracts``.
"""

from __future__ import annotations

from servopt.contracts.artifacts import Artifact, ModelRef, SessionInfo
from servopt.contracts.base import BENCH_SCHEMA, RESULT_SCHEMA, SUMMARY_SCHEMA, Contract
from servopt.contracts.environment import Environment, Topology
from servopt.contracts.instance import (
    Allowance,
    Capacity,
    LoadStep,
    Projection,
    ProjectionCheck,
    Scaling,
    ScalingCurve,
    ScalingPoint,
    ServeConfig,
    ServedData,
    confirming_votes,
)
from servopt.contracts.quality import (
    QUALITY_KINDS,
    Accuracy,
    Agreement,
    AnyQuality,
    ClassificationQuality,
    EmbeddingQuality,
    Gate,
    OtherQuality,
    PairsQuality,
    Quality,
    parse_quality,
    register_quality,
)
from servopt.contracts.record import (
    ChainStep,
    ColdStart,
    CpuReport,
    GridPoint,
    Interference,
    Latency,
    LengthBatching,
    Measured,
    Phase,
    Record,
    Throughput,
)
from servopt.contracts.remeasure import BudgetPlan, BudgetStage, Duel, Duels, Interleaved, OpProfile, OpTime, SideBySide

__all__ = ['BENCH_SCHEMA', 'QUALITY_KINDS', 'RESULT_SCHEMA', 'SUMMARY_SCHEMA', 'Accuracy', 'Agreement', 'Allowance', 'AnyQuality', 'Artifact', 'BudgetPlan', 'BudgetStage', 'Capacity', 'ChainStep', 'ClassificationQuality', 'ColdStart', 'Contract', 'CpuReport', 'Duel', 'Duels', 'EmbeddingQuality', 'Environment', 'Gate', 'GridPoint', 'Interference', 'Interleaved', 'Latency', 'LengthBatching', 'LoadStep', 'Measured', 'ModelRef', 'OpProfile', 'OpTime', 'OtherQuality', 'PairsQuality', 'Phase', 'Projection', 'ProjectionCheck', 'Quality', 'Record', 'Scaling', 'ScalingCurve', 'ScalingPoint', 'ServeConfig', 'ServedData', 'SessionInfo', 'SideBySide', 'Throughput', 'Topology', 'confirming_votes', 'parse_quality', 'register_quality']
