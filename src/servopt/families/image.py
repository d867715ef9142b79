"""Image classifiers: a folder of class sub-folders (or the Food-11 layout) in, class scores out, judged by top-k.

Data: the evaluation split for the figures, the validation split for
calibration and tuning; a single folder (no validation/ beside it) is split,
seeded and per class, into tuning images and held-out evaluation images that no
choice sees (``data.dataset.holdout_split``). Preprocessed as the model expects
(torchvision's resize → center crop → normalize, in Pillow + NumPy). Each folder is the model's class of that name
(names the model carries, or ``--labels``: ``data.labels``), or without names its place in sorted order; the outputs
are logits, probabilities or log-probabilities (``ModelSpec.output_kind``: the graph's final Softmax, or
``--output-kind``), and confidence and served probabilities come from them as they are.
Server: ``POST /v2/models/{name}/classify`` takes JPEG/PNG bytes and answers
the top-k labels with probabilities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from servopt.contracts import Accuracy, ClassificationQuality, Gate, Quality, Record
from servopt.data.dataset import (
    Dataset,
    HoldOut,
    class_folders,
    holdout_split,
    load_image_folder,
    resolve_split,
    scan_image_folder,
)
from servopt.data.labels import IMAGENET, ModelClasses, imagenet, mapping_note, read_labels_file
from servopt.data.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocess, decode_image
from servopt.errors import UserError
from servopt.families.base import DataOptions, Family, register_family
from servopt.families.metrics import (
    LEVEL,
    agreement,
    drop_note,
    paired_drop_interval,
    probabilities,
    samples_to_settle,
    split_agreement,
)
from servopt.spec import ModelSpec, OutputKind

TUNING_LIMIT = 500  # calibration/tuning images read from the validation split, spread over it
TUNING_SHARE = 0.5  # a single folder: the share of each class that tunes (at most TUNING_LIMIT in all); the rest judges
MIN_CONFIDENT = 30  # confident samples the gate needs before it reads their agreement instead of the overall one


class ImageDataOptions(DataOptions):
    data: Path | None = Field(None, description="image folder: <class>/<img> or Food-11 <split>/<class>/<img>")
    split: str | None = Field(None, description="split of a Food-11 layout (default: evaluation)")
    resize: int | None = Field(None, gt=0, description="shorter side after resize (default 224)")
    crop: int | None = Field(None, gt=0, description="center-crop size (default 224)")
    mean: tuple[float, float, float] | None = Field(None, description="normalization mean, e.g. 0.485,0.456,0.406")
    std: tuple[float, float, float] | None = Field(None, description="normalization std, e.g. 0.229,0.224,0.225")
    labels: str | None = Field(None, description="the model's class names: a file, one name a line in its output order, "
                               "or 'imagenet' (folders may then be synset ids, indices or names); default: the names "
                               "the model carries, else sorted folder names")
    output_kind: OutputKind | None = Field(None, description="what the model outputs: logits, probabilities or "
                                       "log-probabilities (default: read from its graph's final Softmax/LogSoftmax)")

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _three_numbers(cls, value: Any) -> Any:
        """``0.485,0.456,0.406`` as the command line gives it."""
        if isinstance(value, str):
            try:
                value = tuple(float(v) for v in value.split(","))
            except ValueError as e:
                raise ValueError(f"three comma-separated numbers, e.g. 0.485,0.456,0.406 (got {value!r})") from e
        return value


def format_accuracy(acc: Accuracy | None) -> str:
    if not acc:
        return "n/a"
    ties = f", {acc.ties} tied" if acc.ties else ""
    paired = ""
    if acc.drop_points is not None and acc.drop_low is not None and acc.drop_high is not None:
        paired = f", {_signed(-acc.drop_points)} pt ({LEVEL:.0%}: {_signed(-acc.drop_high)} … {_signed(-acc.drop_low)})"
    return f"{acc.top1 * 100:.2f}% ({acc.correct}/{acc.total} correct{ties}){paired}"


def _signed(points: float) -> str:
    """``+0.27`` / ``−0.54`` (a true minus sign; 0 as ``0.00``)."""
    text = f"{abs(points):.2f}"
    return text if text == "0.00" else ("+" if points > 0 else "−") + text


def paired_accuracy(acc: Accuracy, outputs: np.ndarray, reference: np.ndarray, labels: np.ndarray) -> Accuracy:
    """``acc`` with the samples lost and gained against the original's answers on the same images, and the drop in
    points with its paired interval (``metrics.paired_drop_interval``)."""
    mine, theirs = outputs.argmax(1) == labels, reference.argmax(1) == labels  # argmax's tie rule, as the top-1 figure
    lost, gained = int((~mine & theirs).sum()), int((mine & ~theirs).sum())
    low, high = paired_drop_interval(lost, gained, len(labels))
    return acc.model_copy(update={"lost": lost, "gained": gained, "drop_points": (lost - gained) / len(labels) * 100,
                                  "drop_low": low * 100, "drop_high": high * 100})


def classification_accuracy(outputs: np.ndarray, labels: np.ndarray) -> Accuracy:
    """Top-1/top-5 against labels. A tie for the top score counts as ``numpy.argmax`` does (the first index:
    a stable sort keeps it first), and ties are counted: quantized models produce exact ties more often."""
    total = len(labels)
    order = np.argsort(-outputs, axis=1, kind="stable")
    top1 = int((order[:, 0] == labels).sum())
    k = min(5, outputs.shape[1])
    top5 = int((order[:, :k] == labels[:, None]).any(axis=1).sum())
    ties = int(((outputs == outputs.max(axis=1, keepdims=True)).sum(axis=1) > 1).sum())
    return Accuracy(top1=top1 / total if total else 0.0, top5=top5 / total if total else 0.0, correct=top1,
                    correct_top5=top5, total=total, ties=ties)


@register_family
class ImageClassification(Family):
    torch_serving = ("torch", "numpy", "pillow")
    name = "image-classification"
    task = "classification"
    DataOptions = ImageDataOptions
    convenience_route = "classify"
    convenience_media_types = ("image/jpeg", "image/png", "image/webp", "image/bmp", "application/octet-stream", "")
    convenience_accepts = "an image: send image/jpeg or image/png bytes, or multipart with a 'file' part"
    # A CNN's two exports are alike, and TorchScript's takes a fraction of the time: the demo MobileNetV2 in 0.35 s
    # against dynamo's 8.4 s on a quiet Zen 4 (49 s of a 5-minute demo beside one busy process on each core); the
    # same INT8 recipe (QOperator U8U8, 7-bit) on each graph ran 1.05x [1.02-1.06] batch-32 throughput and 0.97x p50
    # on TorchScript's, ORT fp32 1.03x and 0.99x, 6 interleaved rounds, same top-1 (docs/benchmarks.md). Dynamo stays
    # behind it for models or torch versions it fails on.
    exporter = "torchscript-first"

    def has_data(self, options: ImageDataOptions) -> bool:
        return options.data is not None

    def _preprocess(self, spec: ModelSpec, options: ImageDataOptions) -> Preprocess:
        base = Preprocess.from_dict(spec.preprocessing)
        first = spec.inputs[0]
        if len(first.shape) != 4:
            raise UserError(f"the model's input {first.name!r} has shape {first.shape}, not an image batch (N, C, H, W)",
                            fix="run without --data to use inputs made from the model's signature")
        fixed = [d for d in first.shape[2:] if isinstance(d, int)]
        size = options.crop or (fixed[0] if fixed else base.crop)
        return Preprocess(resize=options.resize or (base.resize if options.crop is None and not fixed else size), crop=size,
                          mean=options.mean or base.mean or IMAGENET_MEAN, std=options.std or base.std or IMAGENET_STD)

    def _classes(self, spec: ModelSpec, options: ImageDataOptions) -> ModelClasses | None:
        """The classes the data's folders are matched to by name: ``--labels`` (a file, or ImageNet's), else the
        names the model carries (``ModelSpec.class_names``); None: the model names none (sorted folder names then)."""
        if options.labels == IMAGENET:
            classes = imagenet()
        elif options.labels:
            classes = ModelClasses(tuple(read_labels_file(Path(options.labels))), f"--labels {options.labels}")
        elif spec.class_names:
            classes = ModelClasses(tuple(spec.class_names), spec.class_names_from or "the model")
        else:
            return None
        width = self._width(spec)
        if width is not None and (len(classes.names) > width or (options.labels and len(classes.names) != width)):
            raise UserError(f"{len(classes.names)} class names ({classes.source}) for the model's {width} outputs",
                            fix="give one name per output, in the model's output order, with --labels FILE")
        return classes

    @staticmethod
    def _width(spec: ModelSpec) -> int | None:
        width = spec.outputs[0].shape[-1] if spec.outputs else None
        return width if isinstance(width, int) else None

    def _read(self, spec: ModelSpec, options: ImageDataOptions, split: str | None, limit: int | None = None,
              part: HoldOut | None = None) -> Dataset:
        assert options.data is not None
        data = load_image_folder(options.data, split, self._preprocess(spec, options), limit=limit, strict=options.strict,
                                 input_name=spec.inputs[0].name, part=part, model=self._classes(spec, options))
        data.outputs = spec.output_kind
        return data

    def _eval_split(self, options: ImageDataOptions) -> str | None:
        assert options.data is not None
        return options.split or ("evaluation" if (options.data / "evaluation").is_dir() else None)

    def _own_tuning_split(self, options: ImageDataOptions) -> bool:
        """A validation/ split beside the evaluated one: it tunes, and the evaluated split is held out whole."""
        assert options.data is not None
        validation = options.data / "validation"
        return validation.is_dir() and resolve_split(options.data, self._eval_split(options)) != validation

    def _holdout(self, spec: ModelSpec, options: ImageDataOptions) -> bool:
        """Whether the evaluation folder must be split (no validation/ split of its own to tune on) — and can be: a
        folder too small to give any class two images keeps every image for evaluation (read_tuning says so)."""
        assert options.data is not None
        split = self._eval_split(options)
        if self._own_tuning_split(options):
            return False
        items, _, _ = scan_image_folder(resolve_split(options.data, split), self._classes(spec, options))
        tune, _ = holdout_split(np.array([c for _, c in items]), TUNING_SHARE, TUNING_LIMIT)
        return len(tune) > 0

    def read_eval(self, spec: ModelSpec, options: ImageDataOptions) -> tuple[Dataset, ModelSpec]:
        return self._read_eval(spec, options, holdout=True)

    def read_whole(self, spec: ModelSpec, options: ImageDataOptions) -> tuple[Dataset, ModelSpec]:
        return self._read_eval(spec, options, holdout=False)

    def _model_view(self, spec: ModelSpec, options: ImageDataOptions) -> ModelSpec:
        """The spec with what the user said of the model: ``--output-kind``, and ``--labels``' names."""
        update: dict[str, Any] = {"output_kind": options.output_kind} if options.output_kind else {}
        if options.labels:
            classes = self._classes(spec, options)
            assert classes is not None
            update |= {"class_names": list(classes.names), "class_names_from": classes.source}
        return spec.model_copy(update=update)

    def _read_eval(self, spec: ModelSpec, options: ImageDataOptions, holdout: bool) -> tuple[Dataset, ModelSpec]:
        spec = self._model_view(spec, options)
        if options.data is None:
            return self.synthetic(spec), spec
        split = self._eval_split(options)
        part = HoldOut("evaluation", TUNING_SHARE, TUNING_LIMIT) if holdout and self._holdout(spec, options) else None
        dataset = self._read(spec, options, split, options.limit, part)
        folder = resolve_split(options.data, split)
        if part is not None:  # the run's config and report say what the figures were judged on
            dataset.meta["split"] = f"held-out side of a seeded, per-class split of {folder}: the other side tuned every choice"
        classes, width = self._classes(spec, options), self._width(spec)
        if classes is None and width is not None and dataset.labels is not None and len(dataset.class_names or []) > width:
            raise UserError(f"the data has {len(dataset.class_names or [])} classes but the model outputs {width}",
                            fix="check --data points at the data the model was trained for (or --num-classes)")
        dataset.meta["labels"] = mapping_note(class_folders(folder), classes, width)
        dataset.meta["outputs"] = outputs_note(spec.output_kind, given=options.output_kind is not None)
        learned = spec.model_copy(update={"preprocessing": self._preprocess(spec, options).to_dict(),
                                          "class_names": dataset.class_names,
                                          "class_names_from": classes.source if classes else f"the sorted folder names of {folder}"})
        return dataset, learned

    def read_tuning(self, spec: ModelSpec, options: ImageDataOptions) -> tuple[Dataset, list[str]]:
        spec = self._model_view(spec, options)
        if options.data is None:
            return self.synthetic(spec, count=128, seed=7), ["no --data: calibration uses inputs made from the model's signature"]
        split = self._eval_split(options)
        if self._own_tuning_split(options):
            return self._read(spec, options, "validation", TUNING_LIMIT), []
        if not self._holdout(spec, options):
            return self._read(spec, options, split, TUNING_LIMIT), [
                "too few images to hold any out (no class has two): calibration and tuning use the evaluation images, "
                "so the quality verdict is optimistic; add images or a validation/ split"]
        data = self._read(spec, options, split, part=HoldOut("tuning", TUNING_SHARE, TUNING_LIMIT))
        return data, [f"no validation/ split: {resolve_split(options.data, split)} was split (seeded, per class) into "
                      f"{len(data)} tuning images (calibration, refinements, searches) and held-out evaluation images "
                      "that no choice saw (the quality verdict's)"]

    def judge(self, outputs: np.ndarray, data: Dataset, reference: np.ndarray | None) -> ClassificationQuality:
        acc = classification_accuracy(outputs, data.labels) if data.labels is not None else None
        agr = agreement(outputs, reference, "classification") if reference is not None else None
        if agr is not None and agr.error is None:
            assert reference is not None
            agr = split_agreement(agr, outputs, reference, data.outputs)
            if acc is not None and data.labels is not None:
                acc = paired_accuracy(acc, outputs, reference, data.labels)
        return ClassificationQuality(accuracy=acc, agreement=agr)

    def gate_failure(self, quality: Quality, gate: Gate) -> str | None:
        agr, acc = getattr(quality, "agreement", None), getattr(quality, "accuracy", None)
        ref_acc = getattr(gate.reference, "accuracy", None)
        if agr and agr.error:
            return agr.error
        # Where the original is sure (softmax top-1 p > 0.5): on inputs it hesitates over its argmax flips at any
        # rounding, so overall agreement fails sound INT8 variants (58-81 % overall vs 97-100 % confident on real crops).
        # Real losses on every sample are the accuracy drop's to catch (below, and the targets' bounds).
        if agr and agr.top1_agreement_confident is not None and (agr.confident_total or 0) >= MIN_CONFIDENT:
            if agr.top1_agreement_confident < gate.min_agreement:
                return (f"top-1 agreement with the original {agr.top1_agreement_confident:.1%} < {gate.min_agreement:.0%} on "
                        f"the {agr.confident_total} samples it is confident about (p > 0.5; {agr.top1_agreement:.1%} overall)")
        elif agr and agr.top1_agreement is not None and agr.top1_agreement < gate.min_agreement:
            return f"top-1 agreement with the original {agr.top1_agreement:.1%} < {gate.min_agreement:.0%}"
        if acc and ref_acc is not None:
            drop = (ref_acc.top1 - acc.top1) * 100
            if drop > gate.max_drop_points:
                return f"accuracy drop {drop:.2f} points > {gate.max_drop_points} allowed"
        return None

    def gate_shortfall(self, quality: Quality, gate: Gate) -> float | None:
        agr = getattr(quality, "agreement", None)
        if not agr or agr.error or gate.min_agreement >= 1:
            return None
        confident = agr.top1_agreement_confident is not None and (agr.confident_total or 0) >= MIN_CONFIDENT
        figure = agr.top1_agreement_confident if confident else agr.top1_agreement  # the one the gate reads
        return None if figure is None else max(0.0, gate.min_agreement - figure) / (1 - gate.min_agreement)

    def quality_drop(self, record: Record, reference: Record | None) -> float | None:
        """Points of top-1 lost against the original; from agreement when there are no labels."""
        acc = getattr(record.quality, "accuracy", None)
        ref_acc = getattr(reference.quality, "accuracy", None) if reference else None
        if acc and ref_acc:
            return (ref_acc.top1 - acc.top1) * 100
        agr = getattr(record.quality, "agreement", None)
        if agr and agr.top1_agreement is not None:
            return (1 - agr.top1_agreement) * 100
        return 0.0 if reference is not None and record.name == reference.name else None

    def tuning_score(self, outputs: np.ndarray, data: Dataset, float_outputs: np.ndarray) -> float:
        """Top-1 accuracy on labels, or top-1 agreement with the float model without them."""
        truth = data.labels if data.labels is not None else float_outputs.argmax(1)
        return float((outputs.argmax(1) == truth).mean())

    def drop_certainty(self, record: Record, reference: Record, tolerance: float) -> str:
        """The paired interval of the points lost. Labels: top-1 lost/gained against the original; without them the
        share of changed answers (the drop the family reports then), each counted lost."""
        acc, agr = getattr(record.quality, "accuracy", None), getattr(record.quality, "agreement", None)
        ref_acc = getattr(reference.quality, "accuracy", None)
        if acc and ref_acc and acc.lost is not None and acc.gained is not None and acc.total == ref_acc.total:
            counts = (acc.lost, acc.gained, acc.total)
        elif not (acc and ref_acc) and agr and agr.agree is not None and agr.total:
            counts = (agr.total - agr.agree, 0, agr.total)
        else:
            return ""
        low, high = (x * 100 for x in paired_drop_interval(*counts))
        drop = (counts[0] - counts[1]) / counts[2] * 100
        return drop_note(drop, low, high, counts[2], tolerance, settle=lambda: samples_to_settle(*counts, tolerance / 100))

    def describe_quality(self, record: Record) -> str:
        text = format_accuracy(getattr(record.quality, "accuracy", None))
        agr = getattr(record.quality, "agreement", None)
        if agr and agr.top1_agreement is not None and agr.confident_total is not None:
            sure = f"{agr.top1_agreement_confident:.1%} of {agr.confident_total} confident" if agr.confident_total else "none confident"
            text += f"; agrees {agr.top1_agreement:.1%} ({sure})"
        return text

    def tuning_metric(self, data: Dataset) -> str:
        return "top1" if data.labels is not None else "top1 agreement with float"

    def convenience_inputs(self, spec: ModelSpec, body: bytes, max_pixels: int) -> dict[str, np.ndarray]:
        if spec.task != "classification" or len(spec.inputs) != 1 or len(spec.inputs[0].shape) != 4:
            raise UserError("the model is not an image classifier", fix="use /v2/models/{name}/infer")
        if not body:
            raise UserError("the body is empty", fix="send the image bytes")
        x = Preprocess.from_dict(spec.preprocessing)(decode_image(body, max_pixels))
        return {spec.inputs[0].name: x[None]}

    def convenience_params(self, params: dict[str, str]) -> dict[str, Any]:
        try:
            top_k = int(params.get("top_k", 5))
        except ValueError as e:
            raise UserError(f"top_k {params.get('top_k')!r} is not an integer", fix="e.g. ?top_k=3") from e
        if not 1 <= top_k <= 1000:
            raise UserError("top_k must be between 1 and 1000", fix="e.g. ?top_k=3")
        return {"top_k": top_k}

    def convenience_output(self, spec: ModelSpec, output: np.ndarray, params: dict[str, Any]) -> dict[str, Any]:
        probs = probabilities(output[:1], spec.output_kind)[0]  # a Softmax model's probabilities as they are
        order = np.argsort(-probs, kind="stable")[:params["top_k"]]
        labels = spec.class_names or [str(i) for i in range(len(probs))]
        return {"predictions": [{"label": labels[i] if i < len(labels) else str(i), "index": int(i),
                                 "probability": float(probs[i])} for i in order]}


def outputs_note(kind: OutputKind, given: bool) -> str:
    """What the outputs are and where that was read, for the report: confidence is read from them accordingly."""
    why = "--output-kind" if given else {"probabilities": "the graph ends in Softmax",
                                     "log-probabilities": "the graph ends in LogSoftmax",
                                     "logits": "no final Softmax or LogSoftmax in an ONNX graph; "
                                               "--output-kind probabilities says otherwise"}[kind]
    read = {"probabilities": "the top probability as it is", "log-probabilities": "the exp of the top log-probability",
            "logits": "the top probability of their softmax"}[kind]
    return f"{kind} ({why}): confidence is {read}"
