"""How close a variant is to the original: accuracy, agreement, scored pairs, one ``Quality`` kind per family
(registered by kind, so a record reads back as its family's class), and the verification gate."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, SerializeAsAny, field_validator

from servopt.contracts.base import Contract


class Accuracy(Contract):
    """Top-k against labels; a tie for the top score counts as ``numpy.argmax`` does (the first index)."""

    top1: float
    top5: float
    correct: int
    correct_top5: int | None = None
    total: int
    ties: int | None = None  # samples whose top score is shared by several classes
    # Paired with the original on the same samples: how many it got right that this one got wrong (lost) and the reverse
    # (gained), and the top-1 drop in points with its 95 % interval (Bonett and Price's paired interval; docs/targets.md
    # "How sure a quality verdict is"). None on the original itself, or without its outputs.
    lost: int | None = None
    gained: int | None = None
    drop_points: float | None = None
    drop_low: float | None = None
    drop_high: float | None = None


class Agreement(Contract):
    """How closely a variant reproduces the original on the same inputs."""

    max_abs_diff: float | None = None
    mean_abs_diff: float | None = None
    total: int | None = None
    cosine_min: float | None = None
    cosine_mean: float | None = None
    cosine_p1: float | None = None
    top1_agreement: float | None = None
    agree: int | None = None
    retrieval_top10: float | None = None  # overlap of nearest-neighbour lists (embeddings)
    # Variable-length inputs: the mean (and lowest) cosine between a sample's output run alone and run inside a padded
    # batch, and the mean cosine to the original of the outputs run alone. Dynamic INT8 takes its activation scale over
    # the whole padded batch, so a text's embedding depends on what it is batched with — which a server's batcher
    # decides; the quality bound must hold either way.
    batch_consistency: float | None = None
    batch_consistency_min: float | None = None
    cosine_mean_alone: float | None = None
    # Classifiers: top-1 agreement split by the original's confidence (top-1 p > 0.5: "confident"; the softmax of logits,
    # probabilities as they are: ModelSpec.output_kind), with counts.
    # Where the original hesitates its argmax is nearly a coin toss; the verification gate reads the confident part.
    confident_total: int | None = None
    confident_agree: int | None = None
    top1_agreement_confident: float | None = None
    unsure_total: int | None = None
    unsure_agree: int | None = None
    top1_agreement_unsure: float | None = None
    error: str | None = None


class PairsQuality(Contract):
    """How well embedding similarity ranks scored pairs: Spearman correlation of cosine with the scores."""

    spearman: float
    pairs: int
    # Against the original on the same pairs: the Spearman drop in points and its 95 % interval (a seeded paired bootstrap
    # over the pairs; docs/targets.md "How sure a quality verdict is"). None on the original itself.
    drop_points: float | None = None
    drop_low: float | None = None
    drop_high: float | None = None


class Quality(Contract):
    """A model family's judgement of a variant: one kind per family (``Family.judge`` makes it), a discriminated union in
    ``Record.quality``. A family with figures of its own declares a ``Quality`` subclass and registers it
    (``register_quality``): nothing else changes."""

    kind: str = Field(description="which family's judgement this is (the union's discriminator)")


# A record's quality, serialized as what it is (its family's kind), not as the base class.
AnyQuality = SerializeAsAny[Quality]
QUALITY_KINDS: dict[str, type[Quality]] = {}


def register_quality(cls: type[Quality]) -> type[Quality]:
    kind = cls.model_fields["kind"].default
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} must give its kind a default (the discriminator)")
    QUALITY_KINDS[kind] = cls
    return cls


@register_quality
class ClassificationQuality(Quality):
    """Classifiers: top-k against labels, and agreement with the original's answers."""

    kind: Literal["classification"] = "classification"
    accuracy: Accuracy | None = Field(None, description="top1, top5, correct, correct_top5, total, ties on the labelled split; "
                                                        "paired with the original on the same samples: lost, gained, "
                                                        "drop_points and its 95 % interval drop_low … drop_high (points); "
                                                        "null without labels")
    agreement: Agreement | None = Field(None, description="against the original on the same inputs: max_abs_diff, "
                                                          "mean_abs_diff, cosine_*, top1_agreement, agree; split by the "
                                                          "original's top-1 p > 0.5 (logits through a softmax, "
                                                          "probabilities as they are): confident_total, "
                                                          "confident_agree, top1_agreement_confident (what the gate reads), "
                                                          "unsure_total, unsure_agree, top1_agreement_unsure")


@register_quality
class EmbeddingQuality(Quality):
    """Embedding models: closeness to the original's vectors, and ranking of scored pairs."""

    kind: Literal["embedding"] = "embedding"
    agreement: Agreement | None = Field(None, description="against the original: cosine_min, cosine_mean, cosine_p1, "
                                                          "retrieval_top10; inputs of varying length also batch_consistency "
                                                          "(alone vs in a padded batch), its lowest, and cosine_mean_alone")
    pairs: PairsQuality | None = Field(None, description="with scored pairs: Spearman correlation of cosine with the scores, "
                                                         "and the number of pairs; against the original's on the same "
                                                         "pairs: drop_points and its 95 % interval drop_low … drop_high")


class OtherQuality(Quality):
    """The quality of a family not installed here: its fields kept as they were, so its records still read."""

    model_config = ConfigDict(extra="allow")


def parse_quality(value: Any) -> Any:
    """A stored quality back as its family's class, chosen by ``kind``."""
    if not isinstance(value, dict):
        return value
    return QUALITY_KINDS.get(value.get("kind"), OtherQuality).model_validate(value)


class Gate(Contract):
    """Verification bounds: a variant outside them is recorded as failed with its figures and never timed."""

    reference: AnyQuality | None = None  # the original's quality, to compare with
    max_drop_points: float = 5.0
    min_agreement: float = 0.9
    min_cosine: float | None = None

    _quality = field_validator("reference", mode="before")(parse_quality)
