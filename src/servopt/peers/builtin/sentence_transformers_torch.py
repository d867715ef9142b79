"""sentence-transformers as a user runs it by default: ``SentenceTransformer(folder)`` on its torch backend, fp32, in
``torch.inference_mode`` (what ``encode`` does), torch's own thread count.

Its answer is the same module servopt's torch source of the run is (``models.hf_encoder``: Transformer → Pooling →
Normalize, read from the same ``modules.json``), so it is measured as that torch artifact through servopt's torch
runtime, on the run's token ids (the build checks that ST's pooling and normalization are the ones servopt's module
runs); the texts scenarios (``scenarios/texts.py``) time ST's own ``encode()`` instead, texts in: its tokenizing, its
sort by length and its pooling in torch. ST's ONNX backend and its dynamic INT8 export are peers
of their own (``sentence_transformers_onnx.py``: they need Optimum, in an environment of theirs); its OpenVINO backend
is not a peer yet, which this peer says in what it ran."""

from __future__ import annotations

import os
import time

from servopt.peers.base import Encode, Peer, PeerAnswer, PeerInputs, PeerUnavailable, importable, register_peer


def st_encoder(folder: str, **kwargs) -> Encode:
    """``SentenceTransformer(folder, device="cpu", **kwargs).encode`` as a user calls it: texts in, its embeddings out
    (its tokenizer, its sort by length, its pooling and normalization), loaded once."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never the hub
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu", **kwargs)

    def encode(texts: list[str], batch_size: int):
        return model.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)

    return encode


@register_peer
class SentenceTransformersTorch(Peer):
    name = "sentence-transformers"
    description = "sentence-transformers' default backend (torch eager, fp32, inference_mode)"
    families = ("text-embedding",)
    requirements = ("sentence-transformers==6.2.0",)
    encodes = True  # the texts scenarios time its own encode()

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        ok, why = self.applies(inputs)
        if not ok:
            return ok, why
        if inputs.original.format != "torch" or inputs.original.ref is None or inputs.original.ref.kind != "hf_encoder":
            return False, "it loads a Hugging Face sentence-transformers folder, and this run's model is not one"
        return importable("sentence_transformers", "torch", "transformers")

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never the hub
        import sentence_transformers
        import torch
        from sentence_transformers import SentenceTransformer

        from servopt.models.hf_encoder import inspect_encoder

        ref = inputs.original.ref
        assert ref is not None
        t0 = time.perf_counter()
        model = SentenceTransformer(ref.path, device="cpu")
        seconds = time.perf_counter() - t0
        ours = inspect_encoder(ref.path)
        theirs = {type(m).__name__: m for m in model}
        pooling = theirs.get("Pooling")
        config = pooling.get_config_dict() if pooling is not None else {}
        mode = config.get("pooling_mode") or next((k.removeprefix("pooling_mode_") for k, v in config.items()
                                                   if k.startswith("pooling_mode_") and v is True), "mean")
        normalize = "Normalize" in theirs
        if str(mode).replace("_tokens", "").replace("_token", "") != ours.pooling or normalize != ours.normalize:
            raise PeerUnavailable(f"its modules pool {mode}{' and normalize' if normalize else ''}, servopt's torch source "
                                  f"{ours.pooling}{' and normalizes' if ours.normalize else ''}: not the same answer")
        not_here = ["backend='onnx' and its dynamic INT8: the sentence-transformers-onnx(-int8) peers; backend='openvino': "
                    "not compared yet"]
        return PeerAnswer(artifact=inputs.original, runtime="torch", options={"grad_mode": "inference_mode"}, build_s=seconds,
                          configuration={"tool": f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}",
                                         "call": 'SentenceTransformer(folder, device="cpu"); model.encode(texts)',
                                         "modules": list(theirs), "pooling": mode, "normalize": normalize,
                                         "max_seq_length": model.max_seq_length, "torch_threads": torch.get_num_threads(),
                                         "measured_as": "servopt's torch artifact of the same folder (the same modules)",
                                         "not_here": not_here})

    def encoder(self, inputs: PeerInputs, answer: PeerAnswer) -> Encode:
        assert inputs.original.ref is not None
        return st_encoder(inputs.original.ref.path)
