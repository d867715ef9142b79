"""What a model takes and gives: names, dtypes, shapes, its family and how its inputs are prepared.

One ``ModelSpec`` describes every source and runtime so the data, metric and
serving layers never look inside a framework. ``family`` names the plug-in
(``servopt.families``) that reads the model's data, prepares and batches its
inputs, judges a variant against the original and gives the server its
convenience endpoint; ``task`` says what the output means (``classification``:
class scores, logits or probabilities as ``output_kind`` says; ``embedding``: vectors compared by cosine similarity).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Dim = int | str | None  # int = fixed, str = named dynamic axis, None = unknown
Task = Literal["classification", "embedding"]
# What a classifier's output values are: read as they are for confidence and served probabilities (a softmax over
# probabilities flattens them), or through a softmax when they are logits.
OutputKind = Literal["logits", "probabilities", "log-probabilities"]
FAMILY_OF_TASK = {"classification": "image-classification", "embedding": "embedding"}


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

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

    @property
    def named_dims(self) -> list[str]:
        """Named dynamic axes after the batch axis (a text encoder's ``sequence``)."""
        return [d for d in self.shape[1:] if isinstance(d, str)]


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    task: Task = "classification"
    family: str = ""  # filled from ``task`` when empty (see ``family_name``)
    class_names: list[str] | None = None  # in output order: index k's name
    class_names_from: str | None = None  # where they came from (the model's metadata, --labels, the data's folders)
    output_kind: OutputKind = "logits"  # a classifier's: from a final Softmax/LogSoftmax in its graph, or --output-kind
    # The family's input preparation (image resize/crop/normalize; a text encoder's tokenizer), validated by the
    # family's own ``Preprocessing`` model: the spec layer does not know any family's fields.
    preprocessing: dict[str, Any] | None = None
    extra: dict[str, Any] = Field(default_factory=dict)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def family_name(self) -> str:
        return self.family or FAMILY_OF_TASK[self.task]


def image_classifier_spec(num_classes: int | None, size: int = 224) -> ModelSpec:
    """The spec every image classifier in servopt shares (NCHW float32, dynamic batch)."""
    return ModelSpec(
        inputs=[TensorSpec(name="input", dtype="float32", shape=["batch", 3, size, size])],
        outputs=[TensorSpec(name="logits", dtype="float32", shape=["batch", num_classes])],
        task="classification",
        family="image-classification",
    )
