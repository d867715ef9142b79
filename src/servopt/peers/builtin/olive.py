"""Microsoft Olive (``olive-ai``): its ONNX Runtime quantization pass with every option at its default, run the way its
documentation runs a workflow (``olive.workflows.run(config)``, a local system on the CPU execution provider), on the
run's own fp32 ONNX model:

- image classification: ``OnnxStaticQuantization`` calibrated on the run's calibration samples (a user dataset
  registered with Olive's data registry, one sample a batch);
- text embedding: ``OnnxDynamicQuantization`` (no calibration), on servopt's export of the Hugging Face folder, whose
  graph pools and normalizes (``olive auto-opt`` exports with Optimum instead, whose token-level outputs pool outside
  the graph, which servopt's runtimes do not measure).

``olive-search`` (images): the same static pass with Olive's own search over its search space (every option that
declares ``search_defaults``: format, precision and activation type, per channel, reduce range, pre-processing,
calibration method), the ``sequential`` sampler its CLI uses, and objectives that pick what servopt picks: the lowest
latency (Olive's ``latency`` metric) among the models within 1 point of the fp32 model's top-1 on the run's tuning
samples (``accuracy_score``, goal ``max-degradation 0.01``; top-1 agreement with the fp32 model where they have no
labels); Olive counts invalid points of the space too, and tries at most ``SEARCH_POINTS`` (``--quick``: 3). Olive writes under its ``cache_dir`` and ``output_dir`` (the
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

DATASET = "servopt_samples"  # the user dataset registered with Olive's data registry in the build process
ARGMAX = "servopt_argmax"  # the post-processing registered for the accuracy metric
SEARCH_POINTS = 12  # points of Olive's space its search may try (what docs/benchmarks.md's runs used)


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
        config["data_configs"] = [data_config("calibration", str(inputs.calibration), 1)]
        config["passes"]["quantization"]["data_config"] = "calibration"
    return config


def data_config(name: str, path: str, batch_size: int, labels: str | None = None) -> dict:
    params = {"data_path": path, **({"labels_path": labels} if labels else {})}
    return {"name": name, "type": "DataContainer", "load_dataset_config": {"type": DATASET, "params": params},
            **({"post_process_data_config": {"type": ARGMAX}} if labels else {}), "dataloader_config": {"batch_size": batch_size}}


def register_components() -> None:
    """The run's samples as an Olive user dataset ((named inputs, label) pairs, one sample each; labels from
    ``labels_path`` when given) and the argmax its accuracy metric compares with them."""
    from olive.data.registry import Registry

    @Registry.register_post_process(ARGMAX)
    def argmax(output_data, **_kwargs):
        import torch

        logits = output_data if isinstance(output_data, torch.Tensor) else torch.as_tensor(output_data)
        return logits.argmax(dim=-1)

    @Registry.register_dataset(DATASET)
    def samples(data_path: str, labels_path: str | None = None, **_kwargs):
        import numpy as np
        import torch

        from servopt.data.dataset import Dataset

        data = Dataset.load(Path(data_path))
        names = list(data.inputs)
        labels = np.load(labels_path) if labels_path else np.zeros(len(data), dtype=np.int64)

        class Samples(torch.utils.data.Dataset):
            def __len__(self) -> int:
                return len(data)

            def __getitem__(self, i: int):
                return {n: torch.from_numpy(data.inputs[n][i]) for n in names}, int(labels[i])

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
            register_components()
        config = self.config(inputs, static)
        requested = copy.deepcopy(config)  # olive_run replaces parts of the dict it is given with its parsed objects
        inputs.out_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        output = olive_run(config)
        seconds = time.perf_counter() - t0
        best = output.get_best_candidate() if output is not None else None
        footprint = inputs.out_dir / "output" / "footprint.json"
        nodes = json.loads(footprint.read_text()) if footprint.exists() else {}
        if best is None:
            raise RuntimeError("Olive's workflow ran and produced no output model that met its goals (see its log in the build "
                               f"job's job.log); the points it tried: {points(nodes)}")
        path = Path(best.model_path)
        if path.is_dir():
            found = sorted(path.glob("*.onnx"))
            if len(found) != 1:
                raise RuntimeError(f"Olive's output folder {path} holds {len(found)} .onnx files, expected 1")
            path = found[0]
        used = dict((nodes.get(best.model_id) or {}).get("pass_run_config") or {})
        used.pop("data_config", None)
        pass_type = requested["passes"]["quantization"]["type"]
        return PeerAnswer(artifact=Artifact(format="onnx", path=str(path), built_by=f"peer:{self.name}"), build_s=seconds,
                          options=dict(ORT_AS_SHIPPED),
                          configuration={"tool": f"olive-ai {metadata.version('olive-ai')}, onnxruntime {metadata.version('onnxruntime')}",
                                         "call": f"olive.workflows.run(config): input_model ONNXModel(the run's fp32 ONNX), "
                                                 f"passes {{quantization: {pass_type} (defaults)}}, LocalSystem CPUExecutionProvider",
                                         "pass_config_requested": requested["passes"]["quantization"],
                                         "pass_config_used": used or None, **self.described(requested, nodes),
                                         "runs_in": "onnxruntime as shipped (every fusion, its own threads)"})

    def config(self, inputs: PeerInputs, static: bool) -> dict:
        return workflow(inputs, static)

    def described(self, requested: dict, nodes: dict) -> dict:
        """What else its configuration says (the search's space, objectives and points)."""
        return {"not_here": ["Olive's search over the pass's space: the olive-search peer"]}


SEARCHED = ("quant_format", "precision", "activation_type", "per_channel", "reduce_range", "quant_preprocess", "calibrate_method")


def points(nodes: dict) -> list[dict]:
    """Every model Olive made (its footprint), with the searched parameters it ran with and the metrics it measured."""
    out = []
    for model_id, node in nodes.items():
        cfg = node.get("pass_run_config")
        if cfg:
            metrics = (node.get("metrics") or {}).get("value") or {}
            out.append({"model_id": model_id, "params": {k: cfg.get(k) for k in SEARCHED},
                        "metrics": {k: (v.get("value") if isinstance(v, dict) else v) for k, v in metrics.items()}})
    return out


@register_peer
class OliveSearch(Olive):
    name = "olive-search"
    description = ("Olive's search over its static quantization pass's space: the lowest latency within 1 point of fp32's "
                   "top-1 on the tuning samples")
    families = ("image-classification",)

    def environment(self) -> EnvSpec:
        return self.own_environment("olive")  # Olive's: the same requirements, made once

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        return self.needs(inputs, onnx=True, calibration=True, tuning=True)

    def config(self, inputs: PeerInputs, static: bool) -> dict:
        import numpy as np

        from servopt.data.dataset import Dataset

        assert inputs.tuning is not None and inputs.onnx is not None
        tune = Dataset.load(Path(inputs.tuning))
        truth = tune.labels
        if truth is None:  # no labels: agreement with the fp32 model's top-1
            import onnxruntime as ort

            session = ort.InferenceSession(inputs.onnx, providers=["CPUExecutionProvider"])
            truth = np.concatenate([np.argmax(session.run(None, tune.slice(i, i + 1))[0], axis=-1) for i in range(len(tune))])
        inputs.out_dir.mkdir(parents=True, exist_ok=True)
        labels = inputs.out_dir / "tuning-labels.npy"
        np.save(labels, np.asarray(truth, dtype=np.int64))
        classes = int(inputs.spec.outputs[0].shape[-1]) if inputs.spec.outputs and inputs.spec.outputs[0].shape else int(truth.max()) + 1
        samples = 3 if inputs.quick else SEARCH_POINTS
        config = workflow(inputs, True)
        config["data_configs"].append(data_config("tuning", inputs.tuning, 16, str(labels)))
        # "type" is required in practice: without it Olive 0.13 crashes (AttributeError in find_all_resources)
        config["evaluators"] = {"latency_then_accuracy": {"type": "OnnxEvaluator", "metrics": [
            {"name": "latency", "type": "latency", "data_config": "calibration", "sub_types": [{"name": "avg", "priority": 1}]},
            {"name": "accuracy", "type": "accuracy", "data_config": "tuning",
             "sub_types": [{"name": "accuracy_score", "priority": 2,
                            "metric_config": {"task": "multiclass", "num_classes": classes},
                            "goal": {"type": "max-degradation", "value": 0.01}}]}]}}
        config["evaluator"] = "latency_then_accuracy"
        config["evaluate_input_model"] = True  # the accuracy goal is a degradation from the input model
        # Olive 0.13's workflow runner drops sampler_config on its way to the engine, so max_iter bounds the points
        config["search_strategy"] = {"execution_order": "joint", "sampler": "sequential",
                                     "sampler_config": {"max_samples": samples}, "max_iter": samples - 1}
        return config

    def described(self, requested: dict, nodes: dict) -> dict:
        return {"search": {"space": f"OnnxStaticQuantization's search_defaults ({', '.join(SEARCHED)})",
                           "strategy": requested["search_strategy"],
                           "objectives": requested["evaluators"]["latency_then_accuracy"]["metrics"]},
                "search_points": points(nodes)}
