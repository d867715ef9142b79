"""Infinity (``infinity-emb``), the embedding server a user would run instead of ``servopt serve``: its ONNX engine
(``--engine optimum --device cpu``) with ``--pooling-method mean`` (without it the engine pools the first token: cosine
0.52 to the real embeddings), OpenAI's ``/v1/embeddings`` under ``--url-prefix /v1``.

Infinity has no INT8 builder of its own: its ONNX engine serves a file whose name contains ``quantize`` from the model
folder. The build makes it with the tools its ``optimum`` extra installs, as Optimum's guide does: the run's Hugging
Face folder exported by ``ORTModelForFeatureExtraction.from_pretrained(folder, export=True)``, then
``ORTQuantizer.quantize(AutoQuantizationConfig.<preset>(is_static=False, per_channel=True))``, the preset for the
target's instruction set (else this CPU's), per channel like servopt's dynamic INT8 text variants. That model's outputs
are per token (Infinity pools them), so it is measured only served (``PeerAnswer.offline = False``).

Two things a user meets, worked around here and said in what ran: Infinity 0.0.78 hands a local folder's ONNX file to
Optimum as an absolute path, which Optimum refuses ("Could not find any ONNX files with target file name /abs/…"), so
the server runs in the folder with ``--model-id .``; its own graph-optimization step fails with current Optimum and it
serves the unoptimized model. Moved from ``benchmarks/text_servers.py``; its own environment (the pins proven there:
not ``[all]``, which pulls a torchvision that does not import with this torch)."""

from __future__ import annotations

import json
import os
import time
from importlib import metadata
from pathlib import Path

from servopt.contracts import Artifact
from servopt.envs import EnvSpec
from servopt.peers.base import (
    ORT_AS_SHIPPED,
    Peer,
    PeerAnswer,
    PeerInputs,
    PeerUnavailable,
    Server,
    copy_hf_folder,
    register_peer,
)

VERSION = "0.0.78"
MODEL = "model"  # the served model name
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}
START_TIMEOUT_S = 300.0


@register_peer
class Infinity(Peer):
    name = "infinity"
    description = "Infinity's ONNX engine (infinity-emb, Optimum dynamic INT8, mean pooling) serving /v1/embeddings"
    families = ("text-embedding",)
    requirements = (f"infinity-emb[server,optimum,torch]=={VERSION}", "torch==2.13.0")
    serves = "openai-embeddings"

    def environment(self) -> EnvSpec:
        return self.own_environment()

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        return self.needs_hf_folder(inputs, "serves")

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        os.environ.update(OFFLINE)
        try:
            from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTQuantizer
            from optimum.onnxruntime.configuration import AutoQuantizationConfig
        except ImportError as e:
            raise PeerUnavailable(f"infinity-emb's optimum extra does not import in its environment: {e}") from e
        from servopt.peers.builtin.optimum import preset_for

        folder = copy_hf_folder(inputs, "model")
        t0 = time.perf_counter()
        ORTModelForFeatureExtraction.from_pretrained(str(folder), export=True).save_pretrained(str(folder))
        exported = time.perf_counter() - t0
        preset = preset_for(inputs.isa)
        config = getattr(AutoQuantizationConfig, preset)(is_static=False, per_channel=True)
        ORTQuantizer.from_pretrained(str(folder), file_name="model.onnx").quantize(save_dir=str(folder), quantization_config=config)
        quantized = sorted(folder.glob("*quantize*.onnx"))
        if len(quantized) != 1:
            raise RuntimeError(f"the INT8 export left {len(quantized)} *quantize*.onnx files in {folder}, Infinity serves one")
        return PeerAnswer(
            artifact=Artifact(format="onnx", path=str(quantized[0]), built_by=f"peer:{self.name}"), offline=False,
            options=dict(ORT_AS_SHIPPED), build_s=time.perf_counter() - t0,
            configuration={
                "tool": f"infinity-emb {metadata.version('infinity-emb')}, optimum {metadata.version('optimum')}, "
                        f"onnxruntime {metadata.version('onnxruntime')}",
                "call": "ORTModelForFeatureExtraction.from_pretrained(folder, export=True).save_pretrained(folder); "
                        f"ORTQuantizer.from_pretrained(folder, file_name='model.onnx').quantize(AutoQuantizationConfig.{preset}"
                        "(is_static=False, per_channel=True)); infinity_emb v2 --model-id . --engine optimum --device cpu "
                        "--pooling-method mean --url-prefix /v1 (in the folder)",
                "preset": preset, "export_s": round(exported, 1),
                "measured_as": "served only: its ONNX model's outputs are per token and Infinity pools them"})

    def serve(self, inputs: PeerInputs, answer: PeerAnswer, python: Path) -> Server:
        from servopt.serve.harness import AppProcess, free_port

        assert answer.artifact.path is not None
        port = free_port()
        cmd = [str(python.parent / "infinity_emb"), "v2", "--model-id", ".", "--engine", "optimum", "--device", "cpu",
               "--pooling-method", "mean", "--served-model-name", MODEL, "--url-prefix", "/v1", "--host", "127.0.0.1",
               "--port", str(port)]
        env = {**os.environ, **OFFLINE, "HF_HOME": str(inputs.out_dir / "hf-home")}
        env.pop("PYTHONPATH", None)
        # ready when it embeds (it has no health route under the prefix); its output is shown if it does not start
        app = AppProcess(cmd, port, env=env, cwd=Path(answer.artifact.path).parent, ready_path="/v1/embeddings",
                         ready_body=json.dumps({"model": MODEL, "input": ["ready?"]}).encode(), start_timeout_s=START_TIMEOUT_S)
        return Server(url=app.url, model=MODEL, stop=app.stop, api="openai-embeddings", pid=app.proc.pid, command=cmd,
                      start_s=app.start_s)
