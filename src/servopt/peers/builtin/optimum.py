"""Hugging Face Optimum's ONNX Runtime quantization (``optimum-onnx``), as its quantization guide shows:
``ORTQuantizer.from_pretrained(folder, file_name=…)`` with the ``AutoQuantizationConfig`` preset for the CPU the
model will run on (``avx2``, ``avx512`` or ``avx512_vnni``: the target's instruction set, else this CPU's), every
other argument at its default, on the run's own fp32 ONNX model (the original, or servopt's export of a Hugging Face
folder: Optimum's own export writes token-level outputs that pool outside the graph, which servopt's runtimes do not
measure).

- text embedding: dynamic INT8 (``is_static=False``), what Optimum, sentence-transformers'
  ``export_dynamic_quantized_onnx_model`` and Infinity's ONNX engine use for transformers;
- image classification: static INT8 (``is_static=True``) calibrated by ``AutoCalibrationConfig.minmax`` on the run's
  calibration samples (dynamic INT8 is many times slower than fp32 on a CNN).

Its model is run by ONNX Runtime as shipped (what ``ORTModel`` opens: every fusion, its own threads). Moved from
the former ``benchmarks/peers_build.py`` (``optimum-<isa>-minmax``) and ``benchmarks/text_servers.py`` (Infinity's INT8 build).
Optimum pins transformers below 4.58 and needs ``datasets`` for calibration, so it runs in an environment of its own
(the pins the former ``benchmarks/peers_int8.py`` proved)."""

from __future__ import annotations

import json
import os
import time
from importlib import metadata
from pathlib import Path

from servopt.contracts import Artifact
from servopt.envs import EnvSpec
from servopt.peers.base import ORT_AS_SHIPPED, Peer, PeerAnswer, PeerInputs, PeerUnavailable, register_peer

# servopt's instruction-set ladder → Optimum's preset (AMX: Optimum has none; its VNNI preset is the richest)
PRESETS = {"avx2": "avx2", "avx512": "avx512", "avx512_vnni": "avx512_vnni", "amx": "avx512_vnni"}


def preset_for(isa: str | None) -> str:
    """Optimum's ``AutoQuantizationConfig`` preset for ``isa`` (a target's), else for this CPU's richest level."""
    if isa is None:
        from servopt.machine import cpu_features

        isa = str(cpu_features().level or "avx2")
    return PRESETS.get(str(isa), "avx2")


@register_peer
class Optimum(Peer):
    name = "optimum"
    description = "Optimum ORTQuantizer, the AutoQuantizationConfig preset for the target's CPU (dynamic INT8 for text, static minmax for images)"
    families = ("text-embedding", "image-classification")
    # optimum-onnx 0.1.0 pins optimum ~=2.1 and transformers < 4.58 (narrowed here, else pip backtracks through dozens
    # of releases); torch 2.13.0 is the local CPU wheel (a looser pin may pull a CUDA build); datasets: ORTQuantizer.fit
    requirements = ("optimum-onnx==0.1.0", "torch==2.13.0", "transformers>=4.57,<4.58", "datasets==4.4.1")

    def environment(self) -> EnvSpec:
        return self.own_environment()

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        static = inputs.family == "image-classification"
        return self.needs(inputs, onnx=True, calibration=static)

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        try:
            from optimum.onnxruntime import ORTQuantizer
            from optimum.onnxruntime.configuration import AutoCalibrationConfig, AutoQuantizationConfig
        except ImportError as e:
            raise PeerUnavailable(f"optimum-onnx does not import in its environment: {e}") from e

        assert inputs.onnx is not None
        model = Path(inputs.onnx)
        preset = preset_for(inputs.isa)
        static = inputs.family == "image-classification"
        qconfig = getattr(AutoQuantizationConfig, preset)(is_static=static)  # every other argument: its default
        quantizer = ORTQuantizer.from_pretrained(model.parent, file_name=model.name)
        out = inputs.out_dir
        out.mkdir(parents=True, exist_ok=True)
        call = f"ORTQuantizer.from_pretrained(folder, file_name); AutoQuantizationConfig.{preset}(is_static={static})"
        calibration: dict = {}
        t0 = time.perf_counter()
        ranges = None
        if static:
            from datasets import Dataset as HFDataset

            from servopt.data.dataset import Dataset

            assert inputs.calibration is not None
            calib = Dataset.load(Path(inputs.calibration))
            # one row per sample; numpy format so each row reaches ONNX Runtime as float32, not a float64 list
            dataset = HFDataset.from_dict({k: list(v) for k, v in calib.inputs.items()}).with_format("numpy")
            ccfg = AutoCalibrationConfig.minmax(dataset)
            ranges = quantizer.fit(dataset=dataset, calibration_config=ccfg, onnx_augmented_model_name=out / "augmented_model.onnx",
                                   operators_to_quantize=qconfig.operators_to_quantize)
            (out / "augmented_model.onnx").unlink(missing_ok=True)
            calibration = {"method": ccfg.method.name, "samples": len(dataset)}
            call += "; AutoCalibrationConfig.minmax(dataset); quantizer.fit(dataset, calibration_config, operators_to_quantize)"
        save_dir = Path(quantizer.quantize(save_dir=out / "model", quantization_config=qconfig, calibration_tensors_range=ranges))
        seconds = time.perf_counter() - t0
        call += "; quantizer.quantize(save_dir, quantization_config" + (", calibration_tensors_range)" if static else ")")
        produced = sorted(save_dir.glob("*.onnx"))
        if len(produced) != 1:
            raise RuntimeError(f"ORTQuantizer.quantize left {len(produced)} .onnx files in {save_dir}, expected 1")
        ort_config = save_dir / "ort_config.json"
        return PeerAnswer(
            artifact=Artifact(format="onnx", path=str(produced[0]), built_by=f"peer:{self.name}"), build_s=seconds,
            options=dict(ORT_AS_SHIPPED),
            configuration={
                "tool": f"optimum-onnx {metadata.version('optimum-onnx')} (optimum {metadata.version('optimum')}), "
                        f"onnxruntime {metadata.version('onnxruntime')}",
                "call": call, "preset": preset,
                "preset_for": f"the target's instruction set {inputs.isa}" if inputs.isa else "this CPU's instruction set",
                "format": qconfig.format.name, "mode": qconfig.mode.name,
                "activations": qconfig.activations_dtype.name, "weights": qconfig.weights_dtype.name,
                "per_channel": qconfig.per_channel, "reduce_range": qconfig.reduce_range,
                "operators_to_quantize": [getattr(op, "value", op) for op in qconfig.operators_to_quantize],
                **({"calibration": calibration} if calibration else {}),
                "ort_config": json.loads(ort_config.read_text()) if ort_config.exists() else None,
                "runs_in": "onnxruntime as shipped (every fusion, its own threads), as ORTModel opens it"})
