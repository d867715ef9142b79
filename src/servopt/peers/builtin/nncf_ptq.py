"""NNCF's post-training quantization on the ONNX graph, as its documentation shows: ``nncf.quantize(model,
nncf.Dataset(calibration))`` with every option at its default, on the run's fp32 ONNX model and the run's own
calibration samples; the QDQ model it writes is what a user hands to ONNX Runtime (run with ONNX Runtime's defaults).
Moved from the former ``benchmarks/peers_build.py`` (``nncf-onnx-defaults``; ``git show f797dd2:benchmarks/peers_build.py``)."""

from __future__ import annotations

import time
from pathlib import Path

from servopt.contracts import Artifact
from servopt.peers.base import ORT_AS_SHIPPED, Peer, PeerAnswer, PeerInputs, importable, register_peer


@register_peer
class NncfPtq(Peer):
    name = "nncf"
    description = "NNCF post-training INT8 (nncf.quantize, defaults) on the ONNX graph, run by ONNX Runtime"
    families = ("image-classification",)
    requirements = ("nncf==3.4.0",)

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        ok, why = self.needs(inputs, onnx=True, calibration=True)
        return importable("nncf", "onnx") if ok else (ok, why)

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        import nncf
        import onnx

        from servopt.data.dataset import Dataset

        assert inputs.onnx is not None and inputs.calibration is not None
        calib = Dataset.load(Path(inputs.calibration))
        samples = [calib.slice(i, i + 1) for i in range(len(calib))]
        model = onnx.load(inputs.onnx)
        t0 = time.perf_counter()
        quantized = nncf.quantize(model, nncf.Dataset(samples))
        seconds = time.perf_counter() - t0
        path = inputs.out_dir / "model.onnx"
        onnx.save(quantized, str(path))
        return PeerAnswer(artifact=Artifact(format="onnx", path=str(path), built_by=f"peer:{self.name}"), build_s=seconds,
                          options=dict(ORT_AS_SHIPPED),
                          configuration={"tool": f"nncf {nncf.__version__} (ONNX backend)",
                                         "call": "nncf.quantize(model, nncf.Dataset(calibration))",
                                         "calibration_samples": len(samples), "runs_in": "onnxruntime as shipped (every fusion, its own threads)"})
