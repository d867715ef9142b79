"""A third model family as a plugin: tabular classifiers on a CSV (``tests/test_family_plugin.py`` runs it).

Importing this module registers it, as an installed plugin's ``servopt.plugins`` entry point (or ``SERVOPT_PLUGINS``)
would; nothing in servopt names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from servopt.contracts import Accuracy, Agreement, Gate, Quality, Record, register_quality
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.families.base import BoundCheck, DataOptions, Family, register_family
from servopt.families.image import classification_accuracy
from servopt.families.metrics import agreement
from servopt.spec import ModelSpec

FEATURES = 6


@register_quality
class TabularQuality(Quality):
    kind: Literal["tabular"] = "tabular"
    accuracy: Accuracy | None = None
    balanced_accuracy: float | None = None
    agreement: Agreement | None = None


class TableOptions(DataOptions):
    table: Path | None = Field(None, description="a CSV of numeric features and a final 'label' column")


def _read_table(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        raw = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float32, ndmin=2)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not a numeric CSV with a header: {e}", fix="one row per sample, label last") from e
    return raw[:, :-1], raw[:, -1].astype(np.int64)


def _balanced(outputs: np.ndarray, labels: np.ndarray) -> float:
    hits = outputs.argmax(1) == labels
    return float(np.mean([hits[labels == c].mean() for c in np.unique(labels)]))


@register_family
class Tabular(Family):
    name = "tabular"
    task = "classification"
    DataOptions = TableOptions

    def has_data(self, options: TableOptions) -> bool:
        return options.table is not None

    def _split(self, spec: ModelSpec, options: TableOptions, tuning: bool) -> Dataset:
        x, y = _read_table(options.table)
        keep = (np.arange(len(y)) % 4 == 3) == tuning  # every fourth row tunes, the others evaluate
        return Dataset({spec.inputs[0].name: x[keep]}, y[keep], [str(c) for c in sorted(set(y.tolist()))], str(options.table))

    def read_eval(self, spec: ModelSpec, options: TableOptions) -> tuple[Dataset, ModelSpec]:
        return (self._split(spec, options, False), spec) if options.table else (self.synthetic(spec), spec)

    def read_tuning(self, spec: ModelSpec, options: TableOptions) -> tuple[Dataset, list[str]]:
        return (self._split(spec, options, True), []) if options.table else (self.synthetic(spec, seed=7), ["no --table"])

    def judge(self, outputs: np.ndarray, data: Dataset, reference: np.ndarray | None) -> TabularQuality:
        labelled = data.labels is not None
        return TabularQuality(accuracy=classification_accuracy(outputs, data.labels) if labelled else None,
                              balanced_accuracy=_balanced(outputs, data.labels) if labelled else None,
                              agreement=agreement(outputs, reference, "classification") if reference is not None else None)

    def gate_failure(self, quality: Quality, gate: Gate) -> str | None:
        ref = gate.reference
        if isinstance(quality, TabularQuality) and isinstance(ref, TabularQuality) and quality.balanced_accuracy is not None:
            drop = (ref.balanced_accuracy - quality.balanced_accuracy) * 100
            if drop > gate.max_drop_points:
                return f"balanced accuracy drop {drop:.2f} points > {gate.max_drop_points}"
        return None

    def quality_drop(self, record: Record, reference: Record | None) -> float | None:
        mine, theirs = record.quality, reference.quality if reference else None
        if isinstance(mine, TabularQuality) and isinstance(theirs, TabularQuality) and mine.balanced_accuracy is not None:
            return (theirs.balanced_accuracy - mine.balanced_accuracy) * 100
        return None

    def quality_bounds(self, target: Any, record: Record, reference: Record | None) -> list[BoundCheck]:
        mine, theirs = record.quality, reference.quality if reference else None
        plain = None
        if isinstance(mine, TabularQuality) and isinstance(theirs, TabularQuality) and mine.accuracy and theirs.accuracy:
            plain = (theirs.accuracy.top1 - mine.accuracy.top1) * 100
        return [BoundCheck("balanced_accuracy_drop_points", target.max_accuracy_drop, self.quality_drop(record, reference), True,
                           "balanced accuracy against the original"),
                BoundCheck("accuracy_drop_points", target.max_accuracy_drop, plain, True, "plain accuracy against the original")]

    def describe_quality(self, record: Record) -> str:
        q = record.quality
        return f"balanced {q.balanced_accuracy:.3f}" if isinstance(q, TabularQuality) and q.balanced_accuracy is not None else "n/a"

    def tuning_score(self, outputs: np.ndarray, data: Dataset, float_outputs: np.ndarray) -> float:
        return _balanced(outputs, data.labels if data.labels is not None else float_outputs.argmax(1))

    def tuning_metric(self, data: Dataset) -> str:
        return "balanced accuracy"
