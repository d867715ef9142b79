"""What a model takes and gives: names, dtypes, shapes, and the kind of task.

One ``ModelSpec`` describes every source and runtime so the data, metric and
serving layers never look inside a framework. ``task`` decides how outputs are
compared: ``classification`` (logits → top-k against labels) or ``embedding``
(vectors → cosine similarity against a reference), which is how a text encoder
fits without a redesign.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Dim = int | str | None  # int = fixed, str = named dynamic axis, None = unknown
Task = Literal["classification", "embedding"]


@dataclass
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: float32, float16, int64, uint8, bool
    shape: list[Dim]

    def concrete_shape(self, batch: int, overrides: dict[str, int] | None = None) -> list[int]:
        """Fill dynamic axes: the first with ``batch``, named ones from ``overrides``."""
        out: list[int] = []
        for i, d in enumerate(self.shape):
            if isinstance(d, int) and d > 0:
                out.append(d)
            elif i == 0:
                out.append(batch)
            elif isinstance(d, str) and overrides and d in overrides:
                out.append(overrides[d])
            else:
                from servopt.errors import UserError

                raise UserError(
                    f"input {self.name!r} has a dynamic axis {i} ({d!r}) that servopt cannot guess",
                    fix=f"give it with --input-shape {self.name}=" + "x".join(str(x if isinstance(x, int) else "N") for x in self.shape),
                )
        return out


@dataclass
class ModelSpec:
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    task: Task = "classification"
    class_names: list[str] | None = None
    preprocessing: dict | None = None  # image preprocessing the model expects (see data.images.Preprocess)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        return cls(
            inputs=[TensorSpec(**t) for t in d["inputs"]],
            outputs=[TensorSpec(**t) for t in d["outputs"]],
            task=d.get("task", "classification"),
            class_names=d.get("class_names"),
            preprocessing=d.get("preprocessing"),
            extra=d.get("extra", {}),
        )

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]


def image_classifier_spec(num_classes: int | None, size: int = 224) -> ModelSpec:
    """The spec every image classifier in servopt shares (NCHW float32, dynamic batch)."""
    return ModelSpec(
        inputs=[TensorSpec("input", "float32", ["batch", 3, size, size])],
        outputs=[TensorSpec("logits", "float32", ["batch", num_classes])],
        task="classification",
    )
