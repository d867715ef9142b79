"""A model family: everything servopt knows about one kind of model, in one place.

For a family (image classifiers, sentence encoders, …) this says how its data
is read (and split into evaluation and tuning sets), how its inputs are
batched when lengths vary, how a variant is judged against the original, and
what the server's convenience endpoint does. The rest of servopt asks the
family named by ``ModelSpec.family``, so a new family is one file that
registers itself, with no branches elsewhere. Nothing heavy is imported at
module level: the server uses families too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servopt.contracts import EmbeddingQuality, Gate, Quality, Record
from servopt.data.dataset import Dataset, synthetic_inputs
from servopt.errors import UserError
from servopt.families.catalogue import CatalogueContext, Variant, tensor_catalogue
from servopt.families.metrics import LEVEL, agreement, drop_note
from servopt.registry import Registry
from servopt.spec import ModelSpec, Task, TensorSpec


class DataOptions(BaseModel):
    """How the user pointed at data; each family declares its own fields (an unknown one is refused)."""

    model_config = ConfigDict(extra="forbid")

    limit: int | None = Field(None, gt=0, description="evaluate on at most this many samples")
    strict: bool = Field(False, description="fail on an unreadable sample instead of skipping it")


class LengthBatches(BaseModel):
    """The same samples batched as they come and sorted by length, with the padding each wastes."""

    model_config = {"arbitrary_types_allowed": True}

    first_come: list[Any]  # feeds
    sorted: list[Any]
    first_come_waste: float
    sorted_waste: float
    real_tokens: int


@dataclass(frozen=True)
class BoundCheck:
    """One quality bound of a target, as the family measures it: the limit, the variant's value (None: not measured),
    and whether the value must stay under the limit (``upper``) or reach it."""

    bound: str
    limit: float
    value: float | None
    upper: bool
    note: str


class Family(ABC):
    name: ClassVar[str]
    task: ClassVar[Task]
    DataOptions: ClassVar[type[DataOptions]] = DataOptions
    convenience_route: ClassVar[str | None] = None  # POST /v2/models/{name}/<route> on the server
    convenience_media_types: ClassVar[tuple[str, ...]] = ()
    convenience_accepts: ClassVar[str] = ""  # what the endpoint takes, in words (for a 415)
    convenience_body: ClassVar[str] = "bytes"  # "json": the data plane decodes the body before the family sees it
    sweep_grid: ClassVar[tuple[tuple[int, int], ...]] = ()  # (batch, sequence length) points an optimize sweep measures
    bench_grid: ClassVar[tuple[tuple[int, int], ...]] = ()  # … and `servopt bench`
    # What serving the original PyTorch model would install besides a web server: the footprint a package compares with
    torch_serving: ClassVar[tuple[str, ...]] = ("torch", "numpy")
    # Files the spec's preprocessing names that serving needs (a tokenizer): a package carries them beside the model
    serving_files: ClassVar[tuple[str, ...]] = ()
    serving_requirements: ClassVar[tuple[str, ...]] = ()  # what its server needs besides the runtime (a tokenizer)
    # How a torch source of this family is exported to ONNX (``export.EXPORT_ORDER``): torch's default unless measured
    exporter: ClassVar[str] = "auto"
    no_data_note: ClassVar[str] = "no data: inputs are made from the model's signature; only agreement with the original is measured"

    def data_options(self, raw: dict[str, Any]) -> DataOptions:
        """The user's data options for this family; ``None`` values are unset. A flag meant for another family
        is an error naming it, not silently ignored."""
        given = {k: v for k, v in raw.items() if v is not None and v is not False}
        unknown = sorted(set(given) - set(self.DataOptions.model_fields))
        if unknown:
            flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
            raise UserError(f"{flags} do(es) not apply to a {self.name} model",
                            fix=f"{self.name} takes: {', '.join('--' + k.replace('_', '-') for k in self.DataOptions.model_fields)}")
        try:
            return self.DataOptions(**given)
        except ValidationError as e:
            first = e.errors()[0]
            raise UserError(f"--{'.'.join(map(str, first['loc'])).replace('_', '-')}: {first['msg']}", fix="see --help") from e

    def catalogue(self, ctx: CatalogueContext) -> list[Variant]:
        """Every variant servopt knows for this family's models (``families.catalogue``); which run by default follows
        the CPU in ``ctx``. The default suits fixed-shape tensor inputs; a family with other needs declares its own."""
        return tensor_catalogue(ctx)

    @abstractmethod
    def has_data(self, options: DataOptions) -> bool:
        """Whether the user gave real data (else inputs are made from the model's signature)."""

    @abstractmethod
    def read_eval(self, spec: ModelSpec, options: DataOptions) -> tuple[Dataset, ModelSpec]:
        """The evaluation set, and the spec with what the data taught (labels, preprocessing)."""

    def read_whole(self, spec: ModelSpec, options: DataOptions) -> tuple[Dataset, ModelSpec]:
        """The evaluation data when nothing is tuned (``servopt bench``): a family whose ``read_eval`` holds tuning
        samples aside gives every sample here; by default ``read_eval``'s."""
        return self.read_eval(spec, options)

    @abstractmethod
    def read_tuning(self, spec: ModelSpec, options: DataOptions) -> tuple[Dataset, list[str]]:
        """Calibration/tuning samples (never the evaluation split when the data has another), with notes for
        the user (e.g. "no validation split: tuning uses the evaluation images")."""

    def synthetic(self, spec: ModelSpec, count: int = 64, seed: int = 0) -> Dataset:
        return synthetic_inputs(spec, count=count, seed=seed)

    def collate(self, feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Merge requests into one batch (the server's batcher). Same-shaped inputs concatenate."""
        if len(feeds) == 1:
            return feeds[0]
        return {n: np.concatenate([f[n] for f in feeds]) for n in feeds[0]}

    # Inputs for measurements beyond the protocol's single-sample and batch phases (the protocol times them);
    # None where the family has no such axis.
    def grid_feed(self, data: Dataset, batch: int, length: int) -> dict[str, np.ndarray] | None:
        """A batch of ``batch`` samples of sequence length ``length`` (text encoders)."""
        return None

    def length_batches(self, data: Dataset, batch_size: int) -> LengthBatches | None:
        """The evaluation samples batched first-come and sorted by length (text encoders)."""
        return None

    @abstractmethod
    def judge(self, outputs: np.ndarray, data: Dataset, reference: np.ndarray | None) -> Quality:
        """Quality of a variant's outputs (the family's own ``Quality`` kind): against labels where the data has them,
        against the original always."""

    def with_batch_consistency(self, quality: Quality, mean: float, lowest: float, alone: float | None) -> Quality:
        """The quality with how much a sample's output depends on what it is batched with (inputs of varying length
        only: padded batches); families whose outputs cannot depend on it keep it unchanged."""
        return quality

    @abstractmethod
    def gate_failure(self, quality: Quality, gate: Gate) -> str | None:
        """Why a variant is too far from the original to be worth timing, or None (``gate.reference``: the original's
        quality)."""

    def gate_shortfall(self, quality: Quality, gate: Gate) -> float | None:
        """How far ``quality`` falls short of the gate's figure, in units of what the gate itself allows (a 90 %
        agreement gate allows 10 points: 64 % is 2.6 short; 0 where it passes); None where this family cannot say. The
        refinement ladder reads it (``racing.refinement_hopeless``): a search cannot bring back several allowances."""
        return None

    @abstractmethod
    def quality_drop(self, record: Record, reference: Record | None) -> float | None:
        """Points of quality lost against the original (what targets bound as ``max_accuracy_drop``)."""

    def quality_bounds(self, target: Any, record: Record, reference: Record | None) -> list[BoundCheck]:
        """The target's quality bounds as this family measures them (``target``: an ``optimize.targets.Target``). Every
        family bounds the points lost; a family with other figures adds its own bounds here."""
        sure = self.drop_certainty(record, reference, target.max_accuracy_drop) if reference is not None else ""
        return [BoundCheck("accuracy_drop_points", target.max_accuracy_drop, self.quality_drop(record, reference), True,
                           "against the original model" + (f"; {sure}" if sure else ""))]

    def drop_certainty(self, record: Record, reference: Record, tolerance: float) -> str:
        """How sure the points lost are, for the bound's note (``metrics.drop_note``): the interval, and "unsure" with
        about how many samples would settle it when it straddles ``tolerance``. The decision reads the point estimate
        (docs/targets.md "How sure a quality verdict is"); "" where the family has no interval."""
        return ""

    @abstractmethod
    def describe_quality(self, record: Record) -> str:
        """The quality figures of a record in a few words (report tables)."""

    @abstractmethod
    def tuning_score(self, outputs: np.ndarray, data: Dataset, float_outputs: np.ndarray) -> float:
        """The number an accuracy-aware search keeps within tolerance, in [0, 1], higher is better."""

    @abstractmethod
    def tuning_metric(self, data: Dataset) -> str:
        """What ``tuning_score`` measures on this data, for the report."""

    # What clients send over the inference protocol, when it is not the model's own inputs (a text encoder takes
    # strings and tokenizes them here); ``model_inputs`` turns them into the model's, with what it found.
    def sequence_length(self, feed: dict[str, np.ndarray]) -> int | None:
        """A request's sequence length, for batching requests of similar length together (None: no such axis)."""
        return None

    def served_inputs(self, spec: ModelSpec) -> list[TensorSpec]:
        return spec.inputs

    def model_inputs(self, spec: ModelSpec, inputs: dict[str, np.ndarray], params: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
        return inputs, {}

    # The server's convenience endpoint (e.g. an image in, labels out). Families without one keep the defaults.
    def convenience_inputs(self, spec: ModelSpec, body: Any, max_pixels: int) -> dict[str, np.ndarray]:
        raise UserError(f"a {self.name} model has no convenience endpoint", fix="use /v2/models/{name}/infer")

    def convenience_params(self, params: dict[str, str]) -> dict[str, Any]:
        return {}

    def convenience_output(self, spec: ModelSpec, output: np.ndarray, params: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


FAMILIES: Registry[Family] = Registry("model family", "servopt.families")
register_family = FAMILIES.register


def family_of(spec: ModelSpec) -> Family:
    return FAMILIES.get(spec.family_name)


class EmbeddingBase(Family):
    """Judged by how close the vectors stay to the original's: cosine similarity, no labels."""

    task = "embedding"

    def judge(self, outputs: np.ndarray, data: Dataset, reference: np.ndarray | None) -> EmbeddingQuality:
        return EmbeddingQuality(agreement=agreement(outputs, reference, task="embedding") if reference is not None else None)

    def with_batch_consistency(self, quality: Quality, mean: float, lowest: float, alone: float | None) -> Quality:
        agr = getattr(quality, "agreement", None)
        if agr is None or agr.error is not None:
            return quality
        agr = agr.model_copy(update={"batch_consistency": mean, "batch_consistency_min": lowest, "cosine_mean_alone": alone})
        return quality.model_copy(update={"agreement": agr})

    def quality_bounds(self, target: Any, record: Record, reference: Record | None) -> list[BoundCheck]:
        checks = super().quality_bounds(target, record, reference)
        if target.min_cosine is not None:
            agr = getattr(record.quality, "agreement", None)
            is_ref = reference is not None and record.name == reference.name
            cos = 1.0 if is_ref else agr.cosine_mean if agr else None
            checks.append(BoundCheck("cosine_mean", target.min_cosine, cos, False, "embeddings against the original's"))
        return checks

    def drop_certainty(self, record: Record, reference: Record, tolerance: float) -> str:
        """With scored pairs (the points lost are Spearman's then): the paired bootstrap interval of the judge."""
        pairs = getattr(record.quality, "pairs", None)
        if pairs is None or pairs.drop_points is None or pairs.drop_low is None or pairs.drop_high is None:
            return ""
        return drop_note(pairs.drop_points, pairs.drop_low, pairs.drop_high, pairs.pairs, tolerance, "pairs")

    def gate_failure(self, quality: Quality, gate: Gate) -> str | None:
        agr = getattr(quality, "agreement", None)
        if agr and agr.error:
            return agr.error
        if agr and agr.cosine_min is not None and gate.min_cosine is not None and agr.cosine_min < gate.min_cosine:
            return f"cosine similarity to the original {agr.cosine_min:.4f} < {gate.min_cosine}"
        return None

    def quality_drop(self, record: Record, reference: Record | None) -> float | None:
        """(1 − mean cosine) in points: 0.99 mean cosine is a 1-point drop."""
        agr = getattr(record.quality, "agreement", None)
        if agr and agr.cosine_mean is not None:
            return (1 - agr.cosine_mean) * 100
        return 0.0 if reference is not None and record.name == reference.name else None

    def tuning_score(self, outputs: np.ndarray, data: Dataset, float_outputs: np.ndarray) -> float:
        agr = agreement(outputs, float_outputs, task="embedding")
        return float(agr.cosine_mean or 0.0)

    def tuning_metric(self, data: Dataset) -> str:
        return "mean cosine similarity to float"

    def describe_quality(self, record: Record) -> str:
        agr, pairs, parts = getattr(record.quality, "agreement", None), getattr(record.quality, "pairs", None), []
        if agr and agr.cosine_mean is not None:
            parts.append(f"cos {agr.cosine_mean:.4f} (min {agr.cosine_min:.3f})")
        if agr and agr.retrieval_top10 is not None:
            parts.append(f"top-10 {agr.retrieval_top10:.2f}")
        if agr and agr.batch_consistency is not None and agr.batch_consistency < 0.9999:
            low = "" if agr.batch_consistency_min is None else f" (lowest {agr.batch_consistency_min:.4f})"
            parts.append(f"alone vs batched {agr.batch_consistency:.4f}{low}")
        if pairs:
            paired = "" if pairs.drop_low is None or pairs.drop_high is None or pairs.drop_points is None else \
                f" ({-pairs.drop_points:+.2f} pt, {LEVEL:.0%}: {-pairs.drop_high:+.2f} … {-pairs.drop_low:+.2f})"
            parts.append(f"ρ {pairs.spearman:.3f}{paired}")
        return ", ".join(parts) or ("original" if agr is None and record.status == "ok" else "n/a")


