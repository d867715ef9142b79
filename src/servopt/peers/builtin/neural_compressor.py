"""Intel Neural Compressor for ONNX (``onnx-neural-compressor``): post-training static INT8 with its accuracy-driven
auto-tuning, as its documentation shows — ``tuning.autotune(model, TuningConfig(config_set=StaticQuantConfig.
get_config_set_for_tuning()), eval_fn, calibration_data_reader=…)`` with its defaults (tolerable relative loss 1 %, up
to 100 trials), the run's calibration samples, and top-1 on the run's tuning samples as the metric it tunes on (top-1
agreement with the fp32 model where there are no labels; never the held-out evaluation samples). It needs numpy < 2,
so it runs in an environment of its own; its model is measured by servopt's ONNX Runtime as shipped."""

from __future__ import annotations

import time
from importlib import metadata
from pathlib import Path

from servopt.contracts import Artifact
from servopt.envs import EnvSpec
from servopt.peers.base import ORT_AS_SHIPPED, Peer, PeerAnswer, PeerInputs, PeerUnavailable, register_peer


@register_peer
class NeuralCompressor(Peer):
    name = "neural-compressor"
    description = "Intel Neural Compressor (ONNX) static INT8 with accuracy-driven auto-tuning, run by ONNX Runtime"
    families = ("image-classification",)
    # prettytable and scipy: imported by onnx-neural-compressor 1.0 but not declared in its metadata
    requirements = ("onnx-neural-compressor==1.0", "numpy<2", "prettytable==3.18.0", "scipy==1.17.1")

    def environment(self) -> EnvSpec:
        return self.own_environment()

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        return self.needs(inputs, onnx=True, calibration=True, tuning=True)

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        try:
            import onnx
            from onnx_neural_compressor import data_reader
            from onnx_neural_compressor.quantization import config, tuning
        except ImportError as e:
            raise PeerUnavailable(f"onnx-neural-compressor does not import in its environment: {e}") from e
        import numpy as np
        import onnxruntime as ort

        from servopt.data.dataset import Dataset

        assert inputs.onnx is not None and inputs.calibration is not None and inputs.tuning is not None
        calib = Dataset.load(Path(inputs.calibration))
        tune = Dataset.load(Path(inputs.tuning))

        class Reader(data_reader.CalibrationDataReader):
            def __init__(self) -> None:
                self.i = 0

            def get_next(self) -> dict | None:
                if self.i >= len(calib):
                    return None
                self.i += 1
                return calib.slice(self.i - 1, self.i)

            def rewind(self) -> None:
                self.i = 0

        def top1(model_path: str) -> np.ndarray:
            session = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
            return np.concatenate([np.argmax(session.run(None, tune.slice(i, i + 1))[0], axis=-1) for i in range(len(tune))])

        truth = tune.labels if tune.labels is not None else top1(inputs.onnx)
        metric = "top-1 accuracy on the tuning samples" if tune.labels is not None else "top-1 agreement with fp32 on the tuning samples"

        def eval_fn(model_path: str) -> float:
            return float(np.mean(top1(model_path) == truth))

        trials = 3 if inputs.quick else 100
        tune_config = tuning.TuningConfig(config_set=config.StaticQuantConfig.get_config_set_for_tuning(), max_trials=trials)
        t0 = time.perf_counter()
        best = tuning.autotune(inputs.onnx, tune_config, eval_fn=eval_fn, calibration_data_reader=Reader())
        seconds = time.perf_counter() - t0
        if best is None:
            raise RuntimeError(f"autotune found no INT8 model within its tolerable loss (1 % relative {metric}) in {trials} trials")
        path = inputs.out_dir / "model.onnx"
        onnx.save(best, str(path))
        return PeerAnswer(artifact=Artifact(format="onnx", path=str(path), built_by=f"peer:{self.name}"), build_s=seconds,
                          options=dict(ORT_AS_SHIPPED),
                          configuration={"tool": f"onnx-neural-compressor {metadata.version('onnx-neural-compressor')}",
                                         "call": "tuning.autotune(model, TuningConfig(config_set=StaticQuantConfig."
                                                 f"get_config_set_for_tuning(), max_trials={trials}), eval_fn, "
                                                 "calibration_data_reader)", "tuned_on": metric,
                                         "calibration_samples": len(calib), "tuning_samples": len(tune)})
