"""Image preprocessing, exactly as the torchvision tutorials do it, in Pillow + NumPy.

Resize the shorter side (bilinear, antialiased: Pillow's resize filters the
whole support when downsampling, as torchvision does for PIL input), center
crop, scale to [0, 1], normalize, CHW float32. No torch here: the serving
install uses this module too.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field

import numpy as np
from PIL import Image

from servopt.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Decoding is refused past this many pixels (a decompression bomb); 8K×8K is far above any photo.
MAX_IMAGE_PIXELS = 64_000_000


@dataclass
class Preprocess:
    resize: int = 224  # shorter side after resize
    crop: int = 224  # center-crop size
    mean: tuple[float, float, float] = field(default=IMAGENET_MEAN)
    std: tuple[float, float, float] = field(default=IMAGENET_STD)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> Preprocess:
        if not d:
            return cls()
        return cls(resize=d["resize"], crop=d["crop"], mean=tuple(d["mean"]), std=tuple(d["std"]))

    def __call__(self, image: Image.Image) -> np.ndarray:
        return preprocess_image(image, self)


def to_rgb(image: Image.Image) -> Image.Image:
    """Any mode (L, P, RGBA, CMYK, I;16, …) to RGB, the way torchvision's loader does."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        arr = np.asarray(image, dtype=np.float64)
        peak = arr.max() or 1.0
        image = Image.fromarray((arr / peak * 255).astype(np.uint8), mode="L")
    return image.convert("RGB")


def preprocess_image(image: Image.Image, pp: Preprocess) -> np.ndarray:
    image = to_rgb(image)
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = pp.resize, int(pp.resize * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if (new_w, new_h) != (w, h):
        image = image.resize((new_w, new_h), Image.BILINEAR)
    top = int(round((new_h - pp.crop) / 2.0))
    left = int(round((new_w - pp.crop) / 2.0))
    if top < 0 or left < 0:
        raise UserError(f"crop {pp.crop} is larger than the resized image {new_w}x{new_h}", fix="make --crop <= --resize")
    image = image.crop((left, top, left + pp.crop, top + pp.crop))
    arr = np.asarray(image, dtype=np.float32) / 255.0
    arr = (arr - np.asarray(pp.mean, dtype=np.float32)) / np.asarray(pp.std, dtype=np.float32)
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def decode_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode image bytes, refusing truncated files and decompression bombs with a clear message."""
    try:
        image = Image.open(io.BytesIO(data))
        w, h = image.size
        if w * h > max_pixels:
            raise UserError(
                f"image is {w}x{h} = {w * h} pixels, over the {max_pixels} limit (a decompression bomb?)",
                fix="send a smaller image",
            )
        image.load()
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot decode the image: {e}", fix="send a complete JPEG or PNG file") from e
    return image
