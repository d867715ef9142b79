"""A ``Dataset`` is named input arrays (batch first) plus optional labels.

Image folders, synthetic inputs from a model's signature and (later) tokenized
text all become the same thing, saved as one ``.npz`` so each benchmark
subprocess reads exactly the inputs the parent prepared.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from servopt.data.labels import ModelClasses, folder_indices
from servopt.data.preprocess import Preprocess, decode_image
from servopt.errors import UserError
from servopt.machine import usable_cores
from servopt.spec import ModelSpec, OutputKind

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
FOOD11_SPLITS = ("training", "validation", "evaluation")


@dataclass
class Dataset:
    """Named input arrays (batch first) with optional labels.

    Variable-length inputs (token ids) are stored padded to the longest sample, with each sample's real ``lengths``:
    ``slice``, ``batch`` and ``rows`` then cut the padded axis 1 to the longest sample they take, so every batch is
    padded to its own longest, as a real batcher does. ``extras`` carries family data beside the inputs (the pairs
    and scores a text encoder is judged on); ``meta`` what the data taught (token length distribution …);
    ``outputs`` what a classifier's outputs on it are (the judge reads confidence from them as they are)."""

    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None = None
    class_names: list[str] | None = None
    source: str = "synthetic"
    skipped: dict[str, int] = field(default_factory=dict)  # reason → count
    lengths: np.ndarray | None = None
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    outputs: OutputKind = "logits"
    # the file each sample was read from (image folders), in order: what a client of the image endpoint sends. Kept in
    # the saved file's metadata, outside the arrays a data key hashes
    files: list[str] | None = None

    def __len__(self) -> int:
        return len(next(iter(self.inputs.values())))

    def rows(self, idx: np.ndarray | slice) -> dict[str, np.ndarray]:
        """The samples at ``idx`` (variable-length inputs cut to the longest of them)."""
        if self.lengths is None:
            return {k: np.ascontiguousarray(v[idx]) for k, v in self.inputs.items()}
        width = max(1, int(self.lengths[idx].max()))
        return {k: np.ascontiguousarray(v[idx, :width]) for k, v in self.inputs.items()}

    def slice(self, start: int, stop: int) -> dict[str, np.ndarray]:
        return self.rows(slice(start, stop))

    def batch(self, size: int, offset: int = 0) -> dict[str, np.ndarray]:
        """``size`` samples starting at ``offset``, wrapping round (so any batch size works on a small set)."""
        return self.rows((np.arange(size) + offset) % len(self))

    def subset(self, indices: np.ndarray) -> Dataset:
        return Dataset(
            {k: v[indices] for k, v in self.inputs.items()},
            None if self.labels is None else self.labels[indices],
            self.class_names,
            self.source,
            lengths=None if self.lengths is None else self.lengths[indices],
            outputs=self.outputs,
            files=None if self.files is None else [self.files[i] for i in np.arange(len(self))[indices].reshape(-1)],
        )

    def save(self, path: Path) -> None:
        arrays = {f"input:{k}": v for k, v in self.inputs.items()}
        arrays.update({f"extra:{k}": v for k, v in self.extras.items()})
        if self.labels is not None:
            arrays["labels"] = self.labels
        if self.lengths is not None:
            arrays["lengths"] = self.lengths
        meta = {"class_names": self.class_names, "source": self.source, "skipped": self.skipped, "meta": self.meta,
                "outputs": self.outputs, "files": self.files}
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Dataset:
        with np.load(path) as z:
            meta = json.loads(bytes(z["__meta__"]).decode())
            inputs = {k.removeprefix("input:"): z[k] for k in z.files if k.startswith("input:")}
            extras = {k.removeprefix("extra:"): z[k] for k in z.files if k.startswith("extra:")}
            labels = z["labels"] if "labels" in z.files else None
            lengths = z["lengths"] if "lengths" in z.files else None
        return cls(inputs, labels, meta["class_names"], meta["source"], meta.get("skipped", {}), lengths, extras, meta.get("meta", {}),
                   meta.get("outputs", "logits"), meta.get("files"))


HOLDOUT_SEED = 20240613  # fixed: the same folder always splits the same way (records' keys depend on the data)


@dataclass(frozen=True)
class HoldOut:
    """One side of a seeded split of a single folder: ``tuning`` (every choice: calibration, refinements, searches) or
    ``evaluation`` (the held-out samples the verdict is judged on, which no choice saw). ``tuning_share`` is the
    share of each class that tunes, at most ``tuning_max`` samples in all."""

    side: Literal["tuning", "evaluation"]
    tuning_share: float = 0.5
    tuning_max: int | None = None
    seed: int = HOLDOUT_SEED


def holdout_split(strata: np.ndarray, tuning_share: float, tuning_max: int | None = None,
                  seed: int = HOLDOUT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """(tuning indices, held-out indices), disjoint, each sorted: per stratum (a class) a seeded shuffle, of which
    ``floor(share × size)`` tune, so every class keeps its proportion on both sides and a class of one sample is
    only evaluated. ``tuning_max`` lowers the share so that at most that many tune (a large folder keeps the rest
    to judge on)."""
    strata = np.asarray(strata)
    if not 0 < tuning_share < 1:
        raise ValueError(f"tuning_share must be in (0, 1), got {tuning_share}")
    if tuning_max is not None and len(strata):
        tuning_share = min(tuning_share, tuning_max / len(strata))
    rng = np.random.default_rng(seed)
    tuning: list[np.ndarray] = []
    for value in np.unique(strata):
        members = np.flatnonzero(strata == value)
        tuning.append(rng.permutation(members)[:int(len(members) * tuning_share)])
    tune = np.sort(np.concatenate(tuning)) if tuning else np.array([], dtype=np.int64)
    held = np.setdiff1d(np.arange(len(strata)), tune)
    return tune.astype(np.int64), held.astype(np.int64)


def resolve_split(root: Path, split: str | None) -> Path:
    """The folder of class sub-folders: ``root/split`` in the Food-11 layout, else ``root`` itself."""
    if not root.exists():
        raise UserError(f"data folder {root} does not exist", fix="check the --data path")
    if not root.is_dir():
        raise UserError(f"--data {root} is a file, not a folder", fix="pass a folder with one sub-folder per class")
    present = [s for s in FOOD11_SPLITS if (root / s).is_dir()]
    if split:
        if (root / split).is_dir():
            return root / split
        raise UserError(
            f"split {split!r} not found in {root}" + (f" (it has: {', '.join(present)})" if present else ""),
            fix="pick an existing split with --split, or point --data at a folder of class sub-folders",
        )
    if present:
        return root / ("evaluation" if "evaluation" in present else present[-1])
    return root


def class_folders(folder: Path) -> list[str]:
    """The class sub-folders of ``folder``, sorted by name."""
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise UserError(
            f"{folder} has no class sub-folders",
            fix="lay the data out as <data>/<class>/<image> or <data>/<split>/<class>/<image> (Food-11 layout)",
        )
    return classes


def scan_image_folder(folder: Path, model: ModelClasses | None = None) -> tuple[list[tuple[Path, int]], list[str], dict[str, int]]:
    """(file, class index) pairs and the class names by index: with ``model`` (the classes a model knows), each
    folder's index is its class's in the model's output, by name (``data.labels``), and the names are the model's;
    without, the index is the folder's place in sorted order, like torchvision's ImageFolder."""
    folders = class_folders(folder)
    index = folder_indices(folders, model) if model is not None else {name: i for i, name in enumerate(folders)}
    items: list[tuple[Path, int]] = []
    skipped: dict[str, int] = {}
    for name in folders:
        for f in sorted((folder / name).rglob("*")):
            if f.is_dir() or f.name.startswith("."):
                continue
            if f.suffix.lower() in IMAGE_EXTENSIONS:
                items.append((f, index[name]))
            else:
                skipped["not an image file"] = skipped.get("not an image file", 0) + 1
    if not items:
        raise UserError(f"{folder} has class folders ({', '.join(folders[:5])}…) but no images in them", fix="check the folder")
    return items, list(model.names) if model is not None else folders, skipped


def load_image_folder(
    root: str | Path,
    split: str | None = None,
    preprocess: Preprocess | None = None,
    limit: int | None = None,
    strict: bool = False,
    input_name: str = "input",
    workers: int | None = None,
    part: HoldOut | None = None,
    model: ModelClasses | None = None,
) -> Dataset:
    """Decode and preprocess a labelled image folder in parallel threads (Pillow releases the GIL). ``part``: only one
    side of the folder's seeded, class-stratified split (``holdout_split``), taken before ``limit``; ``model``: the
    classes the model knows, which folders are matched to by name (``scan_image_folder``)."""
    preprocess = preprocess or Preprocess()
    folder = resolve_split(Path(root), split)
    items, classes, skipped = scan_image_folder(folder, model)
    if part is not None:
        tune, held = holdout_split(np.array([c for _, c in items]), part.tuning_share, part.tuning_max, part.seed)
        items = [items[i] for i in (tune if part.side == "tuning" else held)]
        if not items:
            raise UserError(f"{folder} has too few images to split into tuning and held-out evaluation samples",
                            fix="add images (at least two per class), or give a validation/ split beside evaluation/")
    if limit is not None and limit < len(items):
        # An even, deterministic spread over classes rather than the first classes only.
        pick = np.linspace(0, len(items) - 1, limit).round().astype(int)
        items = [items[i] for i in pick]

    def work(item: tuple[Path, int]) -> np.ndarray | str:
        try:
            return preprocess(decode_image(item[0].read_bytes()))
        except UserError as e:
            return f"{item[0]}: {e.problem}"

    with ThreadPoolExecutor(max_workers=workers or min(8, usable_cores() * 2)) as pool:
        results = list(pool.map(work, items))
    arrays, labels, errors, files = [], [], [], []
    for (path, label), r in zip(items, results, strict=True):
        if isinstance(r, str):
            errors.append(r)
        else:
            arrays.append(r)
            labels.append(label)
            files.append(str(path))
    if errors:
        if strict:
            raise UserError(f"{len(errors)} image(s) could not be read, first: {errors[0]}", fix="remove them, or drop --strict to skip them")
        skipped["unreadable image"] = len(errors)
        log.warning("skipped %d unreadable image(s), first: %s", len(errors), errors[0])
    if skipped.get("not an image file"):
        log.warning("skipped %d non-image file(s) in %s", skipped["not an image file"], folder)
    if not arrays:
        raise UserError(f"no image in {folder} could be read", fix="check the files")
    source = str(folder) if part is None else f"{folder} ({part.side} side of a seeded split)"
    return Dataset({input_name: np.stack(arrays)}, np.asarray(labels, dtype=np.int64), classes, source, skipped, files=files)


def synthetic_inputs(spec: ModelSpec, count: int = 64, seed: int = 0, shape_overrides: dict[str, int] | None = None) -> Dataset:
    """Inputs made from the model's signature: only agreement with the original can be measured on them."""
    rng = np.random.default_rng(seed)
    inputs: dict[str, np.ndarray] = {}
    for t in spec.inputs:
        shape = t.concrete_shape(count, shape_overrides)
        if t.dtype.startswith("float"):
            inputs[t.name] = rng.standard_normal(shape).astype(t.dtype)
        elif "mask" in t.name:
            inputs[t.name] = np.ones(shape, dtype=t.dtype)
        elif "type_ids" in t.name or "segment" in t.name:  # token types index a 2-row table in BERT-like encoders
            inputs[t.name] = np.zeros(shape, dtype=t.dtype)
        elif t.dtype == "bool":
            inputs[t.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            inputs[t.name] = rng.integers(0, 1000, shape).astype(t.dtype)
    return Dataset(inputs, None, spec.class_names, "synthetic", outputs=spec.output_kind)
