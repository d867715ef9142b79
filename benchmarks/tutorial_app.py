"""The serving tutorial's deployment app: the baseline servopt's server is compared against.

As the tutorial writes it: one FastAPI endpoint taking ``{"image": <base64 JPEG>}``, a plain
``def`` (FastAPI runs it in its thread pool), decoding one image, preprocessing it and running
the model at batch 1 — the PyTorch model under ``torch.no_grad`` (``--arch`` given), or, for a
serving-only comparison, the very ONNX file servopt serves on ONNX Runtime.

    python benchmarks/tutorial_app.py model_state.pt --arch mobilenet_v2 --port 8100   # as the tutorial
    python benchmarks/tutorial_app.py MODEL.onnx --port 8100                           # same model as servopt
"""

from __future__ import annotations

import argparse
import base64
import io

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI
from PIL import Image
from pydantic import BaseModel

from servopt.data.preprocess import Preprocess


class ImageRequest(BaseModel):
    image: str  # base64-encoded JPEG


def build(model: str, arch: str | None) -> FastAPI:
    app = FastAPI()
    pp = Preprocess()
    if arch:
        import torch

        from servopt.models.sources import load_model

        net = load_model(model, arch=arch).torch_module().eval()

        def run(x: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return net(torch.from_numpy(x))[0].numpy()
    else:
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name

        def run(x: np.ndarray) -> np.ndarray:
            return session.run(None, {name: x})[0][0]

    @app.post("/predict")
    def predict(request: ImageRequest) -> dict:
        image = Image.open(io.BytesIO(base64.b64decode(request.image))).convert("RGB")
        logits = run(pp(image)[None])
        return {"prediction": int(np.argmax(logits)), "probability": float(np.exp(logits.max()) / np.exp(logits).sum())}

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--arch", help="the model is a torch state_dict of this zoo architecture (the tutorial's PyTorch app)")
    args = ap.parse_args()
    uvicorn.run(build(args.model, args.arch), host="127.0.0.1", port=args.port, log_level="warning")
