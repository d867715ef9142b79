"""Generic embedding models (an ONNX or torch model whose output is a vector per sample)."""

from __future__ import annotations

from servopt.data.dataset import Dataset
from servopt.families.base import DataOptions, EmbeddingBase, register_family
from servopt.spec import ModelSpec


@register_family
class Embedding(EmbeddingBase):
    """Any model whose output is a vector per sample, judged by cosine similarity to the original; its inputs come
    from its signature (a text encoder folder gets the ``text-embedding`` family instead)."""

    name = "embedding"

    def has_data(self, options: DataOptions) -> bool:
        return False

    def read_eval(self, spec: ModelSpec, options: DataOptions) -> tuple[Dataset, ModelSpec]:
        return self.synthetic(spec), spec

    def read_tuning(self, spec: ModelSpec, options: DataOptions) -> tuple[Dataset, list[str]]:
        return self.synthetic(spec, count=128, seed=7), ["calibration uses inputs made from the model's signature"]
