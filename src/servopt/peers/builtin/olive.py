"""Microsoft Olive (``olive-ai``): its ONNX Runtime quantization pass with every option at its default, run the way its
documentation runs a workflow (``olive.workflows.run(config)``, a local system on the CPU execution provider), on the
run's own fp32 ONNX model:

- image classification: ``OnnxStaticQuantization`` calibrated on the run's calibration samples (a user dataset
  registered with Olive's data registry, one sample a batch);
- text embedding: ``OnnxDynamicQuantization`` (no calibration), on servopt's export of the Hugging Face folder, whose
  graph pools and normalizes (``olive auto-opt`` exports with Optimum instead, whose token-level outputs pool outside
  the graph, which servopt's runtimes do not measure).

Olive's own search over the pass's search space (the former ``benchmarks/peers_build.py``'s ``olive-static-search``: minutes a
point) is not ported yet: this peer is Olive's defaults. Olive writes under its ``cache_dir`` and ``output_dir`` (the
peer's folder); its best candidate is the answer, run by ONNX Runtime as shipped. Moved from the former
``benchmarks/peers_build.py`` (``olive-static-defaults``; ``git show f797dd2:benchmarks/peers_build.py``); its own
environment (the pins the former ``peers_int8.py`` proved)."""

from __future__ import annotations

import copy
import json
import os
import time
from importlib import metadata
from pathlib import Path

from servopt.contracts import Artifact
from servopt.envs import EnvSpec
from servopt.peers.base import ORT_AS_SHIPPED, Peer, PeerAnswer, PeerInputs, PeerUnavailable, register_peer

DATASET = "servopt_calibration"  # the user dataset registered with Olive's data registry in the build process


def workflow(inputs: PeerInputs, static: bool) -> dict:
    """Olive's workflow configuration for the run's model: its quantization pass at its defaults, a local CPU system."""
    assert inputs.onnx is not None
    out = inputs.out_dir
    local = {"type": "LocalSystem", "accelerators": [{"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}]}
    config: dict = {
        "input_model": {"type": "ONNXModel", "model_path": str(inputs.onnx)},
        "systems": {"local_system": local}, "host": "local_system", "target": "local_system",
        "passes": {"quantization": {"type": "OnnxStaticQuantization" if static else "OnnxDynamicQuantization"}},
        "cache_dir": str(out / "cache"), "output_dir": str(out / "output"),
        "evaluate_input_model": False, "log_severity_level": 2,
    }
    if static:
        config["data_configs"] = [{"name": "calibration", "type": "DataContainer",
                                   "load_dataset_config": {"type": DATASET, "params": {"data_path": str(inputs.calibration)}},
                                   "dataloader_config": {"batch_size": 1}}]
        config["passes"]["quantization"]["data_config"] = "calibration"
    return config


def register_dataset() -> None:
    """The run's calibration samples as an Olive user dataset: (named inputs, label) pairs, one sample each."""
    from olive.data.registry import Registry

    @Registry.register_dataset(DATASET)
    def calibration_dataset(data_path: str, **_kwargs):
        import torch

        from servopt.data.dataset import Dataset

        data = Dataset.load(Path(data_path))
        names = list(data.inputs)

        class Samples(torch.utils.data.Dataset):
            def __len__(self) -> int:
                return len(data)

            def __getitem__(self, i: int):
                return {n: torch.from_numpy(data.inputs[n][i]) for n in names}, 0

        return Samples()


@register_peer
class Olive(Peer):
    name = "olive"
    description = "Olive's ONNX Runtime quantization pass at its defaults (static for images, dynamic for text) via olive.workflows.run"
    families = ("image-classification", "text-embedding")
    # torch: Olive's data containers are torch datasets (2.13.0 is the local CPU wheel; a looser pin may pull CUDA);
    # requests: olive-ai 0.13.0 imports it without declaring it ("No module named 'requests'" here)
    requirements = ("olive-ai==0.13.0", "torch==2.13.0", "requests==2.34.2")

    def environment(self) -> EnvSpec:
        return self.own_environment()

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        return self.needs(inputs, onnx=True, calibration=inputs.family == "image-classification")

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        os.environ.setdefault("OLIVE_DISABLE_TELEMETRY", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from olive.workflows import run as olive_run
        except ImportError as e:
            raise PeerUnavailable(f"olive-ai does not import in its environment: {e}") from e

        static = inputs.family == "image-classification"
        if static:
            register_dataset()
        config = workflow(inputs, static)
        requested = copy.deepcopy(config)  # olive_run replaces parts of the dict it is given with its parsed objects
        inputs.out_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        output = olive_run(config)
        seconds = time.perf_counter() - t0
        best = output.get_best_candidate() if output is not None else None
        if best is None:
            raise RuntimeError("Olive's workflow ran and produced no output model (see its log in the build job's job.log)")
        path = Path(best.model_path)
        if path.is_dir():
            found = sorted(path.glob("*.onnx"))
            if len(found) != 1:
                raise RuntimeError(f"Olive's output folder {path} holds {len(found)} .onnx files, expected 1")
            path = found[0]
        used = {}
        footprint = inputs.out_dir / "output" / "footprint.json"
        if footprint.exists():
            nodes = json.loads(footprint.read_text())
            used = dict((nodes.get(best.model_id) or {}).get("pass_run_config") or {})
            used.pop("data_config", None)
        pass_type = requested["passes"]["quantization"]["type"]
        return PeerAnswer(artifact=Artifact(format="onnx", path=str(path), built_by=f"peer:{self.name}"), build_s=seconds,
                          options=dict(ORT_AS_SHIPPED),
                          configuration={"tool": f"olive-ai {metadata.version('olive-ai')}, onnxruntime {metadata.version('onnxruntime')}",
                                         "call": f"olive.workflows.run(config): input_model ONNXModel(the run's fp32 ONNX), "
                                                 f"passes {{quantization: {pass_type} (defaults)}}, LocalSystem CPUExecutionProvider",
                                         "pass_config_requested": requested["passes"]["quantization"],
                                         "pass_config_used": used or None,
                                         "not_here": ["Olive's search over the pass's search space (the former benchmarks/peers_build.py's "
                                                      "olive-static-search) is not ported"],
                                         "runs_in": "onnxruntime as shipped (every fusion, its own threads)"})
