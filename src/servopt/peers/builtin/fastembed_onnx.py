"""fastembed (Qdrant's embedding library): ONNX Runtime with its own session settings and numpy post-processing.

fastembed downloads its models from a hub at run time, which cannot be reached here; it loads a local folder instead
(``TextEmbedding.add_custom_model`` + ``specific_model_path``), so its answer is built from the run's own fp32 ONNX
export (pooled and normalized inside the graph: ``PoolingType.DISABLED``, no second normalization) and the original
folder's tokenizer files. The build loads it with fastembed's defaults, embeds the run's texts where it has them
(checking that it runs), and reads back the session fastembed made; the file is measured by servopt's ONNX Runtime
with those session settings (ORT_ENABLE_ALL, its thread count, every fusion), on the run's token ids."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from servopt.contracts import Artifact
from servopt.envs import EnvSpec
from servopt.peers.base import ORT_AS_SHIPPED, Peer, PeerAnswer, PeerInputs, PeerUnavailable, register_peer

TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
LEVELS = {0: "disable", 1: "basic", 2: "extended", 99: "all"}


@register_peer
class Fastembed(Peer):
    name = "fastembed"
    description = "fastembed's TextEmbedding on the run's fp32 ONNX export (its ONNX Runtime session settings)"
    families = ("text-embedding",)
    requirements = ("fastembed==0.9.1",)

    def environment(self) -> EnvSpec:
        return self.own_environment()

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        ok, why = self.needs(inputs, onnx=True)
        ref = inputs.original.ref
        if ok and (ref is None or not (Path(ref.path) / "tokenizer.json").exists()):
            return False, "fastembed tokenizes with the model folder's tokenizer.json, and the run's original has none"
        return ok, why

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        os.environ["HF_HUB_OFFLINE"] = "1"  # the hub cannot be reached: a local folder only
        try:
            import fastembed
            from fastembed import TextEmbedding
            from fastembed.common.model_description import ModelSource, PoolingType
        except ImportError as e:
            raise PeerUnavailable(f"fastembed does not import in its environment: {e}") from e

        assert inputs.onnx is not None and inputs.original.ref is not None
        folder = inputs.out_dir / "fastembed-model"
        (folder / "onnx").mkdir(parents=True, exist_ok=True)
        onnx_file = Path(inputs.onnx)
        for f in [onnx_file, *onnx_file.parent.glob(onnx_file.name + ".data"), *onnx_file.parent.glob(onnx_file.stem + ".onnx_data")]:
            shutil.copyfile(f, folder / "onnx" / ("model.onnx" if f == onnx_file else f.name))
        for name in TOKENIZER_FILES:
            src = Path(inputs.original.ref.path) / name
            if src.exists():
                shutil.copyfile(src, folder / name)
        dim = inputs.spec.outputs[0].shape[-1] if inputs.spec.outputs and inputs.spec.outputs[0].shape else 0
        model_name = f"servopt-run/{Path(inputs.run_dir).name}"
        if all(m["model"] != model_name for m in TextEmbedding.list_supported_models()):
            TextEmbedding.add_custom_model(model=model_name, pooling=PoolingType.DISABLED, normalization=False,
                                           sources=ModelSource(hf="servopt/local-only"), dim=int(dim) if isinstance(dim, int) else 0,
                                           model_file="onnx/model.onnx")
        t0 = time.perf_counter()
        model = TextEmbedding(model_name, specific_model_path=str(folder), local_files_only=True)
        vectors = list(model.embed(["fastembed runs the run's own export", "a second sentence"]))
        seconds = time.perf_counter() - t0
        session = model.model.model  # fastembed's ONNX Runtime session
        so = session.get_session_options()
        threads = so.intra_op_num_threads or None
        options = {**ORT_AS_SHIPPED, "graph_optimization_level": LEVELS.get(int(so.graph_optimization_level), "all"),
                   **({"intra_op_threads": threads, "inter_op_threads": threads} if threads else {})}
        return PeerAnswer(artifact=Artifact(format="onnx", path=str(folder / "onnx" / "model.onnx"), built_by=f"peer:{self.name}"),
                          options=options, build_s=seconds,
                          configuration={"tool": f"fastembed {fastembed.__version__}",
                                         "call": "TextEmbedding.add_custom_model(model, pooling=DISABLED, normalization=False, "
                                                 "model_file='onnx/model.onnx'); TextEmbedding(model, specific_model_path=folder, "
                                                 "local_files_only=True)",
                                         "providers": session.get_providers(), "threads": threads or "ONNX Runtime's default",
                                         "embedding_dim": int(len(vectors[0])),
                                         "not_here": ["its hub models (it downloads them at run time): the run's own export instead"]})
