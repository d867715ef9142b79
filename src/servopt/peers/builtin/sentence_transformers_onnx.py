"""sentence-transformers' ONNX backend, as its efficiency guide shows: ``SentenceTransformer(folder, backend="onnx")``
exports the model with Optimum and runs it in ONNX Runtime (``sentence-transformers-onnx``), and
``export_dynamic_quantized_onnx_model(model, preset, folder)`` writes its dynamic INT8 model with Optimum's preset for
the CPU (``sentence-transformers-onnx-int8``: the target's instruction set, else this CPU's, as the ``optimum`` peer
picks it).

ST runs its ONNX file for the token embeddings and pools them in torch (its ``Pooling`` and ``Normalize`` modules). So
that servopt's runtimes can measure and judge it on the run's token ids like every other answer, the build appends
those same two steps to ST's graph (masked mean over the tokens, then L2 normalization: ``pool_in_graph``), read from
ST's own modules; a model whose modules do anything else is not this peer's. The texts scenarios
(``scenarios/texts.py``) time ST's own ``encode()`` on its exported file instead, texts in (``encoder``). ST's ONNX session is ONNX Runtime as
shipped (what ``ORTModel`` opens: every fusion, its own threads). It replaces the ONNX half of the former
``benchmarks/text_speed.py`` (docs/benchmarks.md, "Retired scripts"), whose pins it keeps: sentence-transformers 6
cannot have its ``[onnx]`` extra (optimum-onnx caps transformers below 4.58, ST 6 needs 5), so ST 5.7.0."""

from __future__ import annotations

import os
import time
from importlib import metadata
from pathlib import Path
from typing import ClassVar

from servopt.contracts import Artifact
from servopt.envs import EnvSpec
from servopt.peers.base import (
    ORT_AS_SHIPPED,
    Encode,
    Peer,
    PeerAnswer,
    PeerInputs,
    PeerUnavailable,
    copy_hf_folder,
    register_peer,
)

POOLING = "mean"  # the pooling pool_in_graph appends (ST's default for sentence encoders)


def pool_in_graph(src: Path, dst: Path, *, tokens: str, mask: str, output: str, normalize: bool) -> None:
    """``src``'s graph with ST's mean pooling (over the tokens ``mask`` keeps) and, with ``normalize``, its L2
    normalization appended after the ``tokens`` output ([batch, sequence, hidden]); ``output`` ([batch, hidden]) is then
    its only output (``models.onnx_encoder``: the steps servopt appends to an ONNX encoder's graph). Written to
    ``dst`` as one file (the weights inside)."""
    import onnx

    from servopt.models.onnx_encoder import append_pooling, keep_only

    model = onnx.load(str(src))
    found = {o.name: o for o in model.graph.output}
    if tokens not in found:
        raise PeerUnavailable(f"ST's ONNX model has no output {tokens!r} to pool (it has {list(found)})")
    hidden = found[tokens].type.tensor_type.shape.dim[-1].dim_value or "hidden"
    append_pooling(model, tokens=tokens, mask=mask, output=output, pooling=POOLING, normalize=normalize)
    keep_only(model, output, hidden)
    onnx.checker.check_model(model)
    onnx.save(model, str(dst))


@register_peer
class SentenceTransformersOnnx(Peer):
    name = "sentence-transformers-onnx"
    description = "sentence-transformers' ONNX backend (its Optimum export in ONNX Runtime, fp32; pooling appended)"
    int8: ClassVar[bool] = False  # its dynamic INT8 export rather than the fp32 one
    families = ("text-embedding",)
    requirements = ("sentence-transformers==5.7.0", "optimum-onnx==0.1.0", "torch==2.13.0", "transformers>=4.57,<4.58")
    encodes = True  # the texts scenarios time its own encode() on its ONNX file

    def environment(self) -> EnvSpec:
        return self.own_environment("sentence-transformers-onnx")  # one environment for both of this file's peers

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        return self.needs_hf_folder(inputs, "loads")

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        os.environ["HF_HUB_OFFLINE"] = "1"  # a local folder: never the hub
        try:
            import sentence_transformers
            from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model
        except ImportError as e:
            raise PeerUnavailable(f"sentence-transformers' ONNX backend does not import in its environment: {e}") from e
        from servopt.peers.builtin.optimum import preset_for

        folder = copy_hf_folder(inputs, "st-model")
        t0 = time.perf_counter()
        model = SentenceTransformer(str(folder), backend="onnx", device="cpu", model_kwargs={"export": True})
        model.save_pretrained(str(folder))
        call = 'SentenceTransformer(folder, backend="onnx") (its export); model.save_pretrained(folder)'
        preset = None
        if self.int8:
            preset = preset_for(inputs.isa)
            export_dynamic_quantized_onnx_model(model, preset, str(folder))
            call += f'; export_dynamic_quantized_onnx_model(model, "{preset}", folder)'
            written = sorted((folder / "onnx").glob(f"model_*_{preset}.onnx"))
            if len(written) != 1:
                raise RuntimeError(f"the INT8 export left {len(written)} onnx/model_*_{preset}.onnx files in {folder}")
            exported = written[0]
        else:
            exported = folder / "onnx" / "model.onnx"
        seconds = time.perf_counter() - t0
        modules = {type(m).__name__: m for m in model}
        config = modules["Pooling"].get_config_dict() if "Pooling" in modules else {}
        mode = config.get("pooling_mode") or next((k.removeprefix("pooling_mode_").removesuffix("_tokens") for k, v in config.items()
                                                   if k.startswith("pooling_mode_") and v is True), None)
        if mode != POOLING or set(modules) - {"Transformer", "Pooling", "Normalize"}:
            raise PeerUnavailable(f"its modules ({', '.join(modules)}, pooling {mode}) are not Transformer → mean Pooling "
                                  "(→ Normalize), the steps this peer appends to ST's graph")
        mask = "attention_mask"
        if mask not in {i.name for i in inputs.spec.inputs}:
            raise PeerUnavailable("the run's model takes no attention_mask, which ST's mean pooling needs")
        out = inputs.out_dir / f"{self.name}.onnx"
        pool_in_graph(exported, out, tokens="last_hidden_state", mask=mask, output=inputs.spec.outputs[0].name,
                      normalize="Normalize" in modules)
        return PeerAnswer(
            artifact=Artifact(format="onnx", path=str(out), built_by=f"peer:{self.name}"), options=dict(ORT_AS_SHIPPED),
            build_s=seconds,
            configuration={
                "tool": f"sentence-transformers {sentence_transformers.__version__}, optimum-onnx {metadata.version('optimum-onnx')}, "
                        f"onnxruntime {metadata.version('onnxruntime')}",
                "call": call, **({"preset": preset} if preset else {}), "modules": list(modules), "pooling": mode,
                "normalize": "Normalize" in modules, "st_folder": str(folder), "st_file": exported.relative_to(folder).as_posix(),
                "measured_as": f"ST's {exported.name} with its Pooling{' and Normalize' if 'Normalize' in modules else ''} "
                               "appended to the graph (ST runs them in torch after ONNX Runtime), in ONNX Runtime as shipped"})

    def encoder(self, inputs: PeerInputs, answer: PeerAnswer) -> Encode:
        """ST's own ``encode()`` on the file its export wrote (ST's graph, its pooling in torch), as its guide loads it."""
        from servopt.peers.builtin.sentence_transformers_torch import st_encoder

        conf = answer.configuration
        return st_encoder(conf["st_folder"], backend="onnx", model_kwargs={"file_name": conf["st_file"]})


@register_peer
class SentenceTransformersOnnxInt8(SentenceTransformersOnnx):
    name = "sentence-transformers-onnx-int8"
    description = ("sentence-transformers' ONNX backend, its dynamic INT8 export (export_dynamic_quantized_onnx_model, "
                   "Optimum's preset for the target's CPU; pooling appended)")
    int8 = True
