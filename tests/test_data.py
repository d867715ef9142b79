"""Preprocessing against independent computations; image folders, odd files and bad layouts."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from servopt.data.dataset import load_image_folder, synthetic_inputs
from servopt.data.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocess, preprocess_image
from servopt.errors import UserError
from servopt.spec import image_classifier_spec


def _photo(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h)], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8))


def test_crop_and_normalize_match_numpy():
    """Shorter side already 224: resize is the identity, so crop + scale + normalize are checked exactly."""
    img = _photo(300, 224)
    got = preprocess_image(img, Preprocess())
    raw = np.asarray(img, dtype=np.float64)
    left = round((300 - 224) / 2)
    expected = (raw[:, left:left + 224] / 255.0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    assert got.shape == (3, 224, 224) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected.transpose(2, 0, 1), atol=1e-5)


def test_resize_matches_torch_antialiased_bilinear():
    """The antialiased bilinear resize agrees with torch's independent implementation."""
    img = _photo(640, 480, seed=1)
    pp = Preprocess(resize=224, crop=224, mean=(0, 0, 0), std=(1, 1, 1))
    got = preprocess_image(img, pp)
    t = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1)[None]
    resized = torch.nn.functional.interpolate(t, size=(224, 298), mode="bilinear", antialias=True, align_corners=False)
    left = round((298 - 224) / 2)
    expected = resized[0, :, :, left:left + 224].numpy() / 255.0
    assert np.abs(got - expected).mean() < 2 / 255  # Pillow rounds to uint8 between steps
    assert np.abs(got - expected).max() < 8 / 255


@pytest.mark.parametrize("mode", ["L", "RGBA", "CMYK", "P", "I;16"])
def test_every_image_mode_becomes_rgb(mode):
    img = _photo(64, 64).convert(mode) if mode != "I;16" else Image.fromarray((np.arange(64 * 64).reshape(64, 64) * 10).astype(np.uint16))
    out = preprocess_image(img, Preprocess(resize=32, crop=32))
    assert out.shape == (3, 32, 32) and np.isfinite(out).all()


def test_image_folder_class_index_is_sorted_folder_name(tmp_path):
    for name in ["b_cls", "a_cls", "c_cls"]:
        (tmp_path / name).mkdir()
        _photo(40, 30).save(tmp_path / name / "x.png")
    _photo(40, 30).save(tmp_path / "a_cls" / "UPPER.JPG")
    ds = load_image_folder(tmp_path, preprocess=Preprocess(resize=32, crop=32))
    assert ds.class_names == ["a_cls", "b_cls", "c_cls"]
    assert sorted(ds.labels.tolist()) == [0, 0, 1, 2]
    assert ds.inputs["input"].shape == (4, 3, 32, 32)


def test_food11_layout_defaults_to_evaluation(tmp_path):
    for split, n in [("training", 1), ("validation", 2), ("evaluation", 3)]:
        (tmp_path / split / "c").mkdir(parents=True)
        for i in range(n):
            _photo(32, 32, i).save(tmp_path / split / "c" / f"{i}.png")
    assert len(load_image_folder(tmp_path, preprocess=Preprocess(resize=32, crop=32))) == 3
    assert len(load_image_folder(tmp_path, "validation", Preprocess(resize=32, crop=32))) == 2
    with pytest.raises(UserError, match=r"split 'test' not found.*training, validation, evaluation"):
        load_image_folder(tmp_path, "test")


def test_corrupt_and_non_image_files_are_skipped_and_counted(tmp_path):
    (tmp_path / "c").mkdir()
    _photo(32, 32).save(tmp_path / "c" / "good.png")
    (tmp_path / "c" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (tmp_path / "c" / "notes.txt").write_text("hello")
    truncated = (tmp_path / "c" / "good.png").read_bytes()[:60]
    (tmp_path / "c" / "truncated.png").write_bytes(truncated)
    ds = load_image_folder(tmp_path, preprocess=Preprocess(resize=32, crop=32))
    assert len(ds) == 1
    assert ds.skipped == {"not an image file": 1, "unreadable image": 2}
    with pytest.raises(UserError, match="2 image"):
        load_image_folder(tmp_path, preprocess=Preprocess(resize=32, crop=32), strict=True)


@pytest.mark.parametrize("layout", ["missing", "file", "empty", "no_images"])
def test_bad_layouts_are_clear_errors(tmp_path, layout):
    root = tmp_path / "data"
    if layout == "file":
        root.write_text("x")
    elif layout == "empty":
        root.mkdir()
    elif layout == "no_images":
        (root / "cls").mkdir(parents=True)
    with pytest.raises(UserError) as e:
        load_image_folder(root)
    assert e.value.fix


def test_dataset_roundtrip_and_batch_wraps(tmp_path: Path):
    ds = synthetic_inputs(image_classifier_spec(10, size=8), count=5)
    ds.save(tmp_path / "d.npz")
    back = type(ds).load(tmp_path / "d.npz")
    np.testing.assert_array_equal(back.inputs["input"], ds.inputs["input"])
    assert back.batch(7)["input"].shape == (7, 3, 8, 8)
    np.testing.assert_array_equal(back.batch(7)["input"][5], ds.inputs["input"][0])
