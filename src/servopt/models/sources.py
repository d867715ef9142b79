"""Load a model from whatever the user has: ONNX, TorchScript, ``torch.export``
programs, a state_dict plus a zoo architecture, or (only when trusted) a pickle.

A ``LoadedModel`` knows its spec, the files it occupies on disk, and how to be
loaded again in another process (``ref``), which is how the benchmark runs each
variant in its own subprocess.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servopt.contracts import Artifact, ModelRef
from servopt.errors import UserError
from servopt.spec import ModelSpec, TensorSpec, image_classifier_spec

ONNX_META_SPEC = "servopt.spec"  # metadata_props key carrying labels/preprocessing


@dataclass
class LoadedModel:
    kind: str  # onnx | torchscript | exported_program | state_dict | pickle
    path: Path
    spec: ModelSpec
    arch: str | None = None
    num_classes: int | None = None
    trust_pickle: bool = False
    _module: Any = field(default=None, repr=False)

    @property
    def is_torch(self) -> bool:
        return self.kind != "onnx"

    def files(self) -> list[Path]:
        if self.kind == "hf_encoder":
            from servopt.models.hf_encoder import inspect_encoder

            info = inspect_encoder(self.path, trust_pickle=self.trust_pickle)
            files = [*weight_files(info.weights_path), info.model_folder / "config.json", info.tokenizer_path]
            return [f for f in files if f.exists()]
        return model_files(self.path) if self.kind == "onnx" else [self.path]

    def size_mb(self) -> float:
        return sum(f.stat().st_size for f in self.files()) / 1e6

    def torch_module(self):
        """The eval-mode ``nn.Module`` (torch sources only)."""
        if self.kind == "onnx":
            raise UserError("an ONNX model has no torch module", fix="use an ONNX runtime for this model")
        if self._module is None:
            self._module = _load_torch_module(self.path, self.kind, self.arch, self.num_classes, self.trust_pickle)
        return self._module

    def ref(self) -> ModelRef:
        """Everything another process needs to load this model again."""
        return ModelRef(kind=self.kind, path=str(self.path), arch=self.arch, num_classes=self.num_classes,
                        trust_pickle=self.trust_pickle, spec=self.spec)

    @classmethod
    def from_ref(cls, ref: ModelRef) -> LoadedModel:
        return cls(kind=ref.kind, path=Path(ref.path), spec=ref.spec.model_copy(deep=True), arch=ref.arch,
                   num_classes=ref.num_classes, trust_pickle=ref.trust_pickle)


def weight_files(weights: Path) -> list[Path]:
    """A checkpoint's weight files: the file itself, or for a sharded one (``model.safetensors.index.json``,
    ``pytorch_model.bin.index.json``) its index and every shard its ``weight_map`` names, in name order. The weights
    are in the shards: sizing or hashing the index alone would call a 400 MB model 30 KB and miss a changed shard."""
    if not weights.name.endswith(".index.json"):
        return [weights]
    try:
        weight_map = json.loads(weights.read_text(encoding="utf-8")).get("weight_map") or {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise UserError(f"{weights} is not a readable checkpoint index ({e})", fix=f"restore {weights.name} from the original model") from e
    shards = sorted({str(v) for v in weight_map.values()})
    outside = [s for s in shards if Path(s).is_absolute() or ".." in Path(s).parts]
    if outside:
        raise UserError(f"{weights} names shards outside its folder: {', '.join(outside)}", fix="restore the index from the original model")
    return [weights, *(weights.parent / s for s in shards)]


def onnx_tensors(graph: Any) -> Iterator[Any]:
    """Every tensor of an ONNX graph that can hold external data: initializers (sparse ones too) and node attribute
    tensors, in subgraphs as well (as ``onnx.external_data_helper`` walks them: an ``If``/``Loop`` body or a
    ``Constant`` can keep its weights outside the file)."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from onnx_tensors(attr.g)
            for g in attr.graphs:
                yield from onnx_tensors(g)


def external_data(graph: Any) -> Iterator[tuple[str, str]]:
    """(tensor name, ``location``) of every tensor of ``graph`` stored outside the ONNX file."""
    import onnx

    for tensor in onnx_tensors(graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor.name, next((e.value for e in tensor.external_data if e.key == "location"), "")


def model_files(onnx_path: Path) -> list[Path]:
    """The ONNX file and every external-data file its graph references (initializers, attribute tensors, subgraphs),
    each once, as paths under the file's folder (their relative layout kept: ``weights/model.onnx.data``)."""
    import onnx

    files = [onnx_path]
    try:
        proto = onnx.load(str(onnx_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - a broken file is reported where it is loaded
        return files
    for location in dict.fromkeys(loc for _, loc in external_data(proto.graph) if loc):
        files.append(onnx_path.parent / location)
    return [f for f in files if f.exists()]


def artifact_files(artifact: Artifact) -> list[Path]:
    """Every file a built artifact occupies: an ONNX file and its external data, an OpenVINO IR's .xml and .bin,
    a torch reference's source file (or the file saved to measure its size)."""
    if artifact.size_file:
        return [Path(artifact.size_file)]
    if artifact.format == "torch":
        assert artifact.ref is not None
        return LoadedModel.from_ref(artifact.ref).files()
    path = Path(str(artifact.path))
    if artifact.format == "openvino":
        return [path, path.with_suffix(".bin")]
    return model_files(path)


def artifact_size_mb(artifact: Artifact) -> float:
    return sum(f.stat().st_size for f in artifact_files(artifact)) / 1e6


def load_model(
    path: str | Path,
    *,
    arch: str | None = None,
    num_classes: int | None = None,
    trust_pickle: bool = False,
    input_shape: dict[str, list[int]] | None = None,
    task: str | None = None,
    output: str | None = None,
) -> LoadedModel:
    """Detect the format of ``path`` and load it, with a clear error when it cannot. The path is made absolute: the run
    directory records it (the original's artifact), and `servopt serve RUN` from another directory must find it.
    ``output``: the graph output of an ONNX sentence encoder that holds its embedding (``models.onnx_encoder``)."""
    from servopt.models import onnx_encoder

    path = Path(path).absolute()
    if not path.exists():
        raise UserError(f"model file {path} does not exist", fix="check the path")
    if path.is_dir():
        from servopt.models.hf_encoder import encoder_spec, has_torch_weights, inspect_encoder, is_hf_encoder_folder

        onnx_file = onnx_encoder.folder_onnx(path)
        # PyTorch weights win over an ONNX file beside them (pass that file to take it instead)
        if is_hf_encoder_folder(path) and (onnx_file is None or has_torch_weights(path)):
            _no_output(output, path)
            info = inspect_encoder(path, trust_pickle=trust_pickle)
            return LoadedModel("hf_encoder", path, encoder_spec(info), trust_pickle=trust_pickle)
        if onnx_file is None:
            raise UserError(f"{path} is a folder but not a Hugging Face encoder (no config.json with PyTorch weights or "
                            "model.onnx, and a tokenizer.json)",
                            fix="pass a model file (.onnx/.pt/.pth/.pt2), or a folder saved with save_pretrained or "
                                "exported by Optimum")
        return _load_onnx_encoder(onnx_file, path, output, trust_pickle)
    suffix = path.suffix.lower()
    # an ONNX file in its Hugging Face folder is a sentence encoder, tokenized with the folder's tokenizer; one servopt
    # wrote (its spec in the metadata: a built variant, a package's file) is already pooled
    root = onnx_encoder.encoder_root(path) if suffix == ".onnx" else None
    if root is not None and not _has_servopt_spec(path):
        return _load_onnx_encoder(path, root, output, trust_pickle)
    _no_output(output, path)
    if suffix == ".onnx":
        model = _load_onnx(path)
    elif suffix == ".pt2":
        model = _load_exported_program(path)
    elif _is_torchscript(path):
        model = LoadedModel("torchscript", path, image_classifier_spec(None))
        _finish_torch_spec(model, input_shape)
    elif zipfile.is_zipfile(path) or _looks_like_legacy_torch(path):
        model = _load_torch_save(path, arch, num_classes, trust_pickle)
        _finish_torch_spec(model, input_shape)
    else:
        raise UserError(
            f"cannot tell what kind of model {path} is",
            fix="servopt reads .onnx, TorchScript, .pt2 (torch.export) and torch.save files",
        )
    if input_shape and model.kind == "onnx":
        for t in model.spec.inputs:
            if t.name in input_shape:
                t.shape = list(input_shape[t.name])
    if task:
        model.spec.task = task  # type: ignore[assignment]
        model.spec.family = ""
    return model


def _has_servopt_spec(path: Path) -> bool:
    import onnx

    try:
        return any(p.key == ONNX_META_SPEC for p in onnx.load(str(path), load_external_data=False).metadata_props)
    except Exception:  # noqa: BLE001 - an unreadable file is reported where it is loaded
        return False


def _no_output(output: str | None, path: Path) -> None:
    if output is not None:
        raise UserError(f"--output names the embedding output of an ONNX sentence encoder; {path} is not one",
                        fix="drop --output, or pass an ONNX file in its Hugging Face folder (config.json, tokenizer.json)")


def _load_onnx_encoder(onnx_file: Path, root: Path, output: str | None, trust_pickle: bool) -> LoadedModel:
    """An ONNX sentence encoder: the graph servopt runs (pooling appended, ``onnx_encoder.sentence_graph``) as an ONNX
    source of the text family, so its catalogue is that of a graph already in ONNX (no torch, no export)."""
    from servopt.models.onnx_encoder import inspect_onnx_encoder, onnx_encoder_spec, sentence_graph, spec_meta

    enc = inspect_onnx_encoder(onnx_file, root, output, trust_pickle)
    spec = onnx_encoder_spec(enc)
    graph = sentence_graph(enc, model_files(onnx_file), {ONNX_META_SPEC: json.dumps(spec_meta(spec))})
    return LoadedModel("onnx", graph, spec)


def _load_onnx(path: Path) -> LoadedModel:
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise UserError(f"{path} is not a readable ONNX file ({e})", fix="re-export the model") from e
    init_names = {i.name for i in proto.graph.initializer}

    def tensor_spec(vi) -> TensorSpec:
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "float32"
        return TensorSpec(name=vi.name, dtype=dtype, shape=dims)

    inputs = [tensor_spec(v) for v in proto.graph.input if v.name not in init_names]
    outputs = [tensor_spec(v) for v in proto.graph.output]
    meta = {p.key: p.value for p in proto.metadata_props}
    spec = ModelSpec(inputs=inputs, outputs=outputs)
    if ONNX_META_SPEC in meta:
        stored = json.loads(meta[ONNX_META_SPEC])
        spec.task = stored.get("task", spec.task)
        spec.family = stored.get("family", "")
        spec.class_names = stored.get("class_names")
        spec.class_names_from = stored.get("class_names_from") or (spec.class_names and f"{path.name}'s servopt metadata")
        spec.preprocessing = stored.get("preprocessing")
        spec.extra.update(stored.get("text") or {})
    elif outputs and len(outputs[0].shape) != 2:
        spec.task, spec.family = "embedding", "embedding"
    if spec.task == "classification":  # the names and the kind of scores it carries (models/classes.py)
        from servopt.models.classes import final_activation, model_class_names

        width = outputs[0].shape[-1] if outputs else None
        found = None if spec.class_names else model_class_names(meta, path, width if isinstance(width, int) else None)
        if found:
            spec.class_names, spec.class_names_from = found
        opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 13)
        spec.output_kind = final_activation(proto.graph, opset)
        if spec.output_kind == "logits" and ONNX_META_SPEC in meta:  # what --output-kind said when servopt exported it
            spec.output_kind = json.loads(meta[ONNX_META_SPEC]).get("output_kind") or "logits"
    return LoadedModel("onnx", path, spec)


def _load_exported_program(path: Path) -> LoadedModel:
    import torch

    try:
        ep = torch.export.load(str(path))
    except Exception as e:
        raise UserError(f"{path} is not a loadable torch.export program ({e})", fix="save it with torch.export.save") from e
    args, _ = ep.example_inputs if ep.example_inputs else ((), {})
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    placeholders = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    for name in names:
        val = placeholders.get(name)
        if val is not None and val.dim() > 0 and isinstance(val.shape[0], int):
            raise UserError(
                f"{path} was exported with a fixed batch of {val.shape[0]} (input {name!r}); servopt needs to vary the batch",
                fix="export with dynamic_shapes, e.g. torch.export.export(m, (x,), dynamic_shapes=({0: torch.export.Dim('batch')},))",
            )
    inputs = [
        TensorSpec(name=names[i] if i < len(names) else f"input_{i}", dtype=str(a.dtype).removeprefix("torch."),
                   shape=["batch", *a.shape[1:]])
        for i, a in enumerate(args)
    ]
    model = LoadedModel("exported_program", path, ModelSpec(inputs=inputs or image_classifier_spec(None).inputs, outputs=[]))
    model._module = ep.module()
    _finish_torch_spec(model, None)
    return model


def _is_torchscript(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(n.endswith("constants.pkl") or "/code/" in n for n in z.namelist())


def _looks_like_legacy_torch(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x80\x02"  # protocol-2 pickle: torch.save before 1.6


def _load_torch_save(path: Path, arch: str | None, num_classes: int | None, trust_pickle: bool) -> LoadedModel:
    import torch

    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Unsupported global" not in str(e):  # not a pickled object: a damaged file
            raise UserError(f"{path} could not be read by torch.load (damaged or not a torch file)",
                            fix="check that the file is complete") from e
        if not trust_pickle:
            raise UserError(
                f"{path} is a pickled Python object (torch.save(model)); unpickling it can run arbitrary code, "
                "so servopt refuses it by default",
                fix="if you trust the file, pass --trust-pickle; better, save model.state_dict() and pass --arch, "
                "or export the model to ONNX or TorchScript",
            ) from e
        return LoadedModel("pickle", path, image_classifier_spec(None), trust_pickle=True)
    except Exception as e:
        raise UserError(f"{path} could not be read by torch.load ({e})", fix="check that the file is complete") from e
    state = _extract_state_dict(obj)
    if state is None:
        raise UserError(f"{path} holds a {type(obj).__name__}, not a state_dict", fix="save model.state_dict()")
    if arch is None:
        from servopt.models.zoo import ARCHITECTURES

        raise UserError(
            f"{path} is a state_dict (weights only); servopt needs the architecture to rebuild the model",
            fix=f"pass --arch with one of: {', '.join(ARCHITECTURES)}",
        )
    if num_classes is None:
        head = state.get("classifier.1.weight", state.get("fc.weight"))
        num_classes = int(head.shape[0]) if head is not None else 1000
    return LoadedModel("state_dict", path, image_classifier_spec(num_classes), arch=arch, num_classes=num_classes)


def _extract_state_dict(obj: Any) -> dict | None:
    import torch

    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, dict):
        for key in ("state_dict", "model_state_dict", "model"):
            if key in obj and isinstance(obj[key], dict):
                return _extract_state_dict(obj[key])
    return None


class _ZooUnpickler(pickle.Unpickler):
    """Maps torchvision classes to the zoo so a torchvision pickle loads without torchvision."""

    def find_class(self, module: str, name: str):
        from servopt.models.zoo import TORCHVISION_CLASS_MAP

        if (module, name) in TORCHVISION_CLASS_MAP:
            return TORCHVISION_CLASS_MAP[(module, name)]
        if module.startswith("torchvision"):
            try:
                return super().find_class(module, name)
            except Exception as e:
                raise UserError(
                    f"the pickle needs {module}.{name}, which the zoo does not provide and torchvision cannot import here",
                    fix="save the model's state_dict and pass --arch, or export it to ONNX",
                ) from e
        return super().find_class(module, name)


class _zoo_pickle_module:  # noqa: N801 - stands in for the ``pickle`` module torch.load expects
    Unpickler = _ZooUnpickler
    load = staticmethod(pickle.load)


def _load_torch_module(path: Path, kind: str, arch: str | None, num_classes: int | None, trust_pickle: bool):
    import torch

    if kind == "hf_encoder":
        from transformers.utils import logging as hf_logging

        from servopt.models.hf_encoder import load_sentence_encoder

        hf_logging.disable_progress_bar()  # its "Loading weights" bar would tear servopt's own progress display
        return load_sentence_encoder(path, trust_pickle=trust_pickle)
    if kind == "torchscript":
        module = torch.jit.load(str(path), map_location="cpu")
    elif kind == "exported_program":
        module = torch.export.load(str(path)).module()
    elif kind == "state_dict":
        from servopt.models.zoo import build

        module = build(arch or "", num_classes or 1000)
        state = _extract_state_dict(torch.load(str(path), map_location="cpu", weights_only=True))
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise UserError(
                f"the weights in {path} do not fit --arch {arch} with {num_classes} classes: {str(e).splitlines()[0]}",
                fix="check --arch and --num-classes against how the model was trained",
            ) from e
    elif kind == "pickle":
        if not trust_pickle:
            raise UserError(f"{path} is a pickle", fix="pass --trust-pickle if you trust it")
        module = torch.load(str(path), map_location="cpu", weights_only=False, pickle_module=_zoo_pickle_module)
        if not isinstance(module, torch.nn.Module):
            raise UserError(f"{path} unpickles to a {type(module).__name__}, not an nn.Module", fix="save the model itself")
    else:
        raise ValueError(kind)
    if hasattr(module, "eval") and kind != "exported_program":
        module.eval()
    return module


def _finish_torch_spec(model: LoadedModel, input_shape: dict[str, list[int]] | None) -> None:
    """Fix the input shape, then learn the output shape by running the module once."""
    import torch

    spec = model.spec
    if input_shape:
        spec.inputs = [TensorSpec(name=n, dtype="float32", shape=["batch", *s[1:]]) for n, s in input_shape.items()]
    module = model.torch_module()
    example = [torch.zeros(t.concrete_shape(1), dtype=getattr(torch, t.dtype)) for t in spec.inputs]
    try:
        with torch.inference_mode():
            out = module(*example)
    except Exception as e:
        shapes = ", ".join(f"{t.name}={'x'.join(map(str, t.concrete_shape(1)))}" for t in spec.inputs)
        raise UserError(
            f"the model failed on an input of shape {shapes}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            fix="give the right shape with --input-shape NAME=1x3x224x224",
        ) from e
    if isinstance(out, (tuple, list)):
        out = out[0]
    if isinstance(out, dict):
        out = next(iter(out.values()))
    spec.outputs = [TensorSpec(name="logits", dtype="float32", shape=["batch", *out.shape[1:]])]
    if out.dim() == 2 and model.num_classes is None:
        model.num_classes = int(out.shape[1])
    if out.dim() != 2:
        spec.task, spec.family = "embedding", "embedding"
