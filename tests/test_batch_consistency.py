"""A text's embedding may depend on what it is batched with (dynamic INT8 scales activations over the whole padded
batch): the quality bound must hold for texts served alone and in batches, held to means like the bound itself."""

from __future__ import annotations

import numpy as np

from servopt.bench.protocol import batch_consistency, predict_all
from servopt.contracts import Agreement, EmbeddingQuality, Gate, SessionInfo
from servopt.data.dataset import Dataset
from servopt.families.text import TextEmbedding
from servopt.runtimes.base import Session

rng = np.random.default_rng(0)
N, WIDTH, DIM = 24, 12, 16
PROJ = rng.normal(size=(100, DIM))


def _texts() -> Dataset:
    lengths = rng.integers(3, WIDTH + 1, size=N)
    ids = rng.integers(1, 100, size=(N, WIDTH))
    mask = (np.arange(WIDTH)[None, :] < lengths[:, None]).astype(np.int64)
    return Dataset(inputs={"input_ids": ids * mask, "attention_mask": mask}, lengths=lengths)


class _Pooled(Session):
    """Mean-pooled random token embeddings; ``coupling`` mixes in the batch's mean, as a per-batch scale would."""

    def __init__(self, coupling: float) -> None:
        self.input_names = ["input_ids", "attention_mask"]
        self.coupling = coupling

    def run_prepared(self, feed):
        mask = feed["attention_mask"][..., None]
        out = (PROJ[feed["input_ids"]] * mask).sum(1) / mask.sum(1)
        return out + self.coupling * out.mean(0, keepdims=True)

    def info(self) -> SessionInfo:
        return SessionInfo(runtime="test")


def test_a_batch_invariant_model_is_consistent():
    data = _texts()
    session = _Pooled(0.0)
    out = predict_all(session, data, 8)
    mean, low, alone = batch_consistency(session, data, 8, reference=out)
    assert mean > 0.999999 and low > 0.999999 and alone > 0.999999


def test_a_batch_dependent_model_is_caught():
    data = _texts()
    ref = predict_all(_Pooled(0.0), data, 8)
    session = _Pooled(0.5)
    mean, low, alone = batch_consistency(session, data, 8, reference=ref)
    assert low <= mean < 0.99, "alone vs batched differs"
    assert alone > mean, "alone, the coupling is to itself: closer to the original than in a batch"


def test_the_gate_holds_means_alone_and_batched():
    family, gate = TextEmbedding(), Gate(min_cosine=0.99)

    def fails(**agr) -> str | None:
        base = {"cosine_mean": 0.995, "cosine_mean_alone": 0.996, "batch_consistency": 0.995, "batch_consistency_min": 0.985}
        return family.gate_failure(EmbeddingQuality(agreement=Agreement(**{**base, **agr})), gate)

    assert fails() is None, "a lowest single text under the mean bound does not fail a mean bound"
    assert "batched with" in (fails(batch_consistency=0.985) or "")
    assert "alone" in (fails(cosine_mean_alone=0.98) or "")
    assert "mean cosine" in (fails(cosine_mean=0.98) or "")


class _Widths(_Pooled):
    """Records the padded width of every call."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.widths: list[int] = []

    def run_prepared(self, feed):
        self.widths.append(feed["input_ids"].shape[0] * feed["input_ids"].shape[1])
        return super().run_prepared(feed)


def test_predict_all_batches_by_length_and_keeps_the_data_order():
    data = _texts()
    session = _Widths()
    out = predict_all(session, data, 8)
    one_by_one = np.concatenate([_Pooled(0.0).run_prepared(data.slice(i, i + 1)) for i in range(len(data))])
    np.testing.assert_allclose(out, one_by_one, rtol=1e-12)  # each row is its own sample's, whatever the batching
    arrival = sum(max(1, int(data.lengths[i:i + 8].max())) * len(data.lengths[i:i + 8]) for i in range(0, len(data), 8))
    assert sum(session.widths) < arrival, "sorted batches pad fewer tokens than arrival-order ones"
