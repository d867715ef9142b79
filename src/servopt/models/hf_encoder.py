"""Sentence-transformer text encoders (MiniLM, MPNet, BERT, BGE, E5) from a Hugging Face folder.

A folder saved by sentence-transformers (``modules.json``: Transformer → Pooling
→ optional Normalize) or a bare ``AutoModel`` folder becomes one ``nn.Module``
whose output is the sentence embedding itself: pooling and L2 normalization run
inside ``forward``, so every export or compile of it gives the same vector
sentence-transformers gives, and the serving side only tokenizes.

``inspect_encoder`` reads JSON files only (no torch, no transformers), so a lean
install can recognise and describe a folder; ``SentenceEncoder`` (built on first
use, see ``__getattr__``) and the export need torch and transformers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from servopt.errors import UserError
from servopt.spec import ModelSpec, TensorSpec

if TYPE_CHECKING:  # the real class is built lazily so importing this module needs no torch
    import torch

    SentenceEncoder: type[torch.nn.Module]

log = logging.getLogger(__name__)

Pooling = Literal["mean", "cls", "max", "mean_sqrt_len"]
POOLING_MODES: tuple[str, ...] = ("mean", "cls", "max", "mean_sqrt_len")
DEFAULT_POOLING_SOURCE = "default (mean; no sentence-transformers config)"
PROTOBUF_LIMIT = 2 * 1024**3

# sentence-transformers' Pooling config keys → our names. Modes we cannot reproduce are refused, not approximated.
_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")
# Families whose position ids start after the padding index (RoBERTa's scheme): usable length = max positions - offset.
_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "longformer", "data2vec-text", "ibert", "luke"}
# type_vocab_size when config.json leaves it out (older saves wrote only differences from the defaults).
_TYPE_VOCAB_DEFAULTS = {"bert": 2, "electra": 2, "convbert": 2, "mobilebert": 2, "albert": 2, "ernie": 2, "megatron-bert": 2}
_SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_OTHER_WEIGHTS = ("tf_model.h5", "flax_model.msgpack", "model.onnx", "onnx/model.onnx")


@dataclass
class EncoderInfo:
    """What a text-encoder folder holds, read from its files without loading the model."""

    folder: Path  # the folder the user gave
    model_folder: Path  # where config.json, the weights and the tokenizer are (a sub-folder in old layouts)
    model_type: str  # config.json's model_type: bert, mpnet, xlm-roberta, …
    architecture: str | None  # config.json's architectures[0], when given
    hidden_size: int
    vocab_size: int
    pad_token_id: int
    pooling: Pooling
    pooling_source: str  # "modules.json", or DEFAULT_POOLING_SOURCE for a bare AutoModel folder
    normalize: bool
    max_seq_length: int
    max_seq_length_source: str
    max_positions: int | None  # the longest sequence the position embeddings allow (None: no such limit known)
    uses_token_type_ids: bool
    do_lower_case: bool  # sentence_bert_config.json: lower-case texts before tokenizing
    tokenizer_path: Path
    # the PyTorch weights; None only for a folder read for its ONNX file (``inspect_encoder(..., weights=False)``)
    weights_path: Path | None
    weights_format: Literal["safetensors", "pickle"] | None
    trust_pickle: bool = False

    def input_names(self) -> list[str]:
        return ["input_ids", "attention_mask"] + (["token_type_ids"] if self.uses_token_type_ids else [])

    def to_dict(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def _read_json(path: Path, what: str, fix: str) -> Any:
    if not path.is_file():
        raise UserError(f"{path.parent} has no {path.name} ({what})", fix=fix)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not readable JSON ({e})", fix=f"restore {path.name} from the original model") from e


def is_hf_encoder_folder(path: str | Path) -> bool:
    """True when ``path`` looks like a Hugging Face model folder (sentence-transformers or bare AutoModel).

    Cheap and never raises: it only decides which loader to try; ``inspect_encoder`` says what is wrong.
    """
    folder = Path(path)
    try:
        if not folder.is_dir():
            return False
        if (folder / "modules.json").is_file() or (folder / "sentence_bert_config.json").is_file():
            return True
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        has_weights = any((folder / w).is_file() for w in (*_SAFE_WEIGHTS, *_PICKLE_WEIGHTS))
        return isinstance(config, dict) and "model_type" in config and has_weights
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def has_torch_weights(folder: str | Path) -> bool:
    """True when a Hugging Face folder holds PyTorch weights (safetensors or a pickle), where its ``modules.json``
    puts the Transformer. Never raises: which loader to try (a folder may hold an ONNX export instead, or as well)."""
    root = Path(folder)
    try:
        model_dir = _module_dir(root, _read_modules(root), "Transformer") or root
    except UserError:
        model_dir = root
    return any((model_dir / w).is_file() for w in (*_SAFE_WEIGHTS, *_PICKLE_WEIGHTS))


def _read_modules(root: Path) -> list[dict] | None:
    path = root / "modules.json"
    if not path.is_file():
        return None
    modules = _read_json(path, "the sentence-transformers pipeline", "")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise UserError(f"{path} is not a sentence-transformers module list", fix="restore modules.json from the original model")
    for m in modules:
        kind = str(m["type"]).rsplit(".", 1)[-1]
        if kind not in _SUPPORTED_MODULES:
            raise UserError(
                f"{path} has a {m['type']} module; servopt reproduces only Transformer → Pooling → Normalize, "
                "so its embeddings would differ from sentence-transformers'",
                fix="use a model whose modules.json lists only Transformer, Pooling and Normalize, or export it to ONNX yourself",
            )
    return modules


def _module_dir(root: Path, modules: list[dict] | None, kind: str) -> Path | None:
    for m in modules or []:
        if str(m["type"]).rsplit(".", 1)[-1] == kind:
            return root / m.get("path", "")
    return None


def _read_pooling(pool_dir: Path, hidden_size: int) -> Pooling:
    cfg = _read_json(
        pool_dir / "config.json", "the Pooling module's settings",
        fix="restore the pooling folder's config.json from the original model (modules.json points at it)",
    )
    if isinstance(cfg.get("pooling_mode"), str):  # some writers store the mode by name
        modes = [cfg["pooling_mode"].replace("_tokens", "").replace("_token", "")]
    else:
        modes = [name for key, name in _POOLING_KEYS.items() if cfg.get(key)]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise UserError(
            f"{pool_dir / 'config.json'} asks for pooling {' + '.join(modes) or 'none'}; servopt supports exactly one of "
            + ", ".join(POOLING_MODES),
            fix="use a model with one of those pooling modes",
        )
    dim = cfg.get("word_embedding_dimension")
    if dim is not None and int(dim) != hidden_size:
        raise UserError(
            f"the pooling config says the token embeddings have {dim} dimensions but config.json says {hidden_size}",
            fix="the folder mixes two models: restore it from the original",
        )
    return modes[0]  # type: ignore[return-value]


def _weights(model_dir: Path, trust_pickle: bool) -> tuple[Path, Literal["safetensors", "pickle"]]:
    for name in _SAFE_WEIGHTS:
        if (model_dir / name).is_file():
            return model_dir / name, "safetensors"
    for name in _PICKLE_WEIGHTS:
        if (model_dir / name).is_file():
            if not trust_pickle:
                raise UserError(
                    f"{model_dir / name} is a pickle: loading it can run arbitrary code",
                    fix="pass --trust-pickle if you trust its source, or convert it to model.safetensors "
                    "(AutoModel.from_pretrained(folder).save_pretrained(folder, safe_serialization=True))",
                )
            return model_dir / name, "pickle"
    others = [n for n in _OTHER_WEIGHTS if (model_dir / n).exists()]
    raise UserError(
        f"{model_dir} has no model.safetensors (the PyTorch weights)" + (f"; it has only {', '.join(others)}" if others else ""),
        fix="save the model with model.save_pretrained(folder), which writes model.safetensors",
    )


def _optional_weights(model_dir: Path, trust_pickle: bool) -> tuple[Path | None, Literal["safetensors", "pickle"] | None]:
    """The PyTorch weights where the folder has loadable ones (a pickle only when trusted), else (None, None)."""
    try:
        return _weights(model_dir, trust_pickle)
    except UserError:
        return None, None


def _max_seq_length(model_dir: Path, root: Path, config: dict, max_positions: int | None) -> tuple[int, str]:
    def capped(value: int, source: str) -> tuple[int, str]:
        if max_positions is not None and value > max_positions:
            return max_positions, f"{source} ({value}), capped at the model's {max_positions} positions"
        return value, source

    for d in dict.fromkeys((model_dir, root)):
        sbert = d / "sentence_bert_config.json"
        if sbert.is_file():
            value = _read_json(sbert, "", "").get("max_seq_length")
            if isinstance(value, int) and value > 0:
                return capped(value, "sentence_bert_config.json")
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        value = _read_json(tok_cfg, "", "").get("model_max_length")
        if isinstance(value, (int, float)) and 0 < value < 1_000_000:  # transformers writes 1e30 for "no limit"
            return capped(int(value), "tokenizer_config.json model_max_length")
    if max_positions is not None:
        return max_positions, "config.json max_position_embeddings"
    return 512, "default (512; no length found in the folder)"


def inspect_encoder(folder: str | Path, trust_pickle: bool = False, *, weights: bool = True) -> EncoderInfo:
    """Read a sentence-transformers or bare ``AutoModel`` folder: pooling, normalization, lengths, files.

    Only JSON files are read; every missing or unusable file is a ``UserError`` naming it. ``weights=False``: a folder
    read for its ONNX file (``models.onnx_encoder``), whose PyTorch weights may be absent (``weights_path`` None then).
    """
    root = Path(folder)
    if not root.exists():
        raise UserError(f"model folder {root} does not exist", fix="check the path")
    if not root.is_dir():
        raise UserError(f"{root} is a file, not a Hugging Face model folder", fix="pass the folder that holds config.json")
    modules = _read_modules(root)
    model_dir = _module_dir(root, modules, "Transformer") or root
    config = _read_json(
        model_dir / "config.json", "the model's architecture",
        fix="save the model with model.save_pretrained(folder), which writes config.json",
    )
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise UserError(f"{model_dir / 'config.json'} has no model_type", fix="save the model with transformers' save_pretrained")
    if config.get("is_encoder_decoder") or config.get("is_decoder"):
        raise UserError(
            f"{root} holds a {model_type} {'encoder-decoder' if config.get('is_encoder_decoder') else 'decoder'} model; "
            "servopt's text encoders are encoder-only (BERT, MPNet, RoBERTa families)",
            fix="use an encoder-only sentence-transformers model",
        )
    hidden = config.get("hidden_size") or config.get("dim") or config.get("d_model")
    if not isinstance(hidden, int):
        raise UserError(f"{model_dir / 'config.json'} gives no hidden_size", fix="restore config.json from the original model")
    pad_id = config.get("pad_token_id")
    pad_id = int(pad_id) if isinstance(pad_id, int) else (1 if model_type in _OFFSET_POSITIONS else 0)
    max_pos = config.get("max_position_embeddings")
    offset = 0
    if model_type in _OFFSET_POSITIONS:  # positions run pad+1 … ; MPNet hard-codes its padding index 1
        offset = (1 if model_type == "mpnet" else pad_id) + 1
    max_positions = int(max_pos) - offset if isinstance(max_pos, int) else None
    type_vocab = config.get("type_vocab_size", _TYPE_VOCAB_DEFAULTS.get(model_type, 0))

    tokenizer = model_dir / "tokenizer.json"
    if not tokenizer.is_file():
        raise UserError(
            f"{model_dir} has no tokenizer.json (the fast tokenizer servopt tokenizes with)"
            + (" — it has vocab.txt, a slow tokenizer's file" if (model_dir / "vocab.txt").is_file() else ""),
            fix="save a fast tokenizer into the folder: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)",
        )
    weights_path, weights_format = _weights(model_dir, trust_pickle) if weights else _optional_weights(model_dir, trust_pickle)

    if modules is None:
        pooling: Pooling = "mean"
        pooling_source = DEFAULT_POOLING_SOURCE
        normalize = False
    else:
        pool_dir = _module_dir(root, modules, "Pooling")
        if pool_dir is None:
            pooling, pooling_source = "mean", "default (mean; modules.json has no Pooling module)"
        else:
            pooling, pooling_source = _read_pooling(pool_dir, hidden), "modules.json"
        normalize = _module_dir(root, modules, "Normalize") is not None
    max_len, max_len_source = _max_seq_length(model_dir, root, config, max_positions)
    lower = False
    sbert = model_dir / "sentence_bert_config.json"
    if sbert.is_file():
        lower = bool(_read_json(sbert, "", "").get("do_lower_case", False))
    arch = config.get("architectures")
    return EncoderInfo(
        folder=root, model_folder=model_dir, model_type=model_type,
        architecture=arch[0] if isinstance(arch, list) and arch else None,
        hidden_size=int(hidden), vocab_size=int(config.get("vocab_size") or 0), pad_token_id=pad_id,
        pooling=pooling, pooling_source=pooling_source, normalize=normalize,
        max_seq_length=max_len, max_seq_length_source=max_len_source, max_positions=max_positions,
        uses_token_type_ids=isinstance(type_vocab, int) and type_vocab > 1, do_lower_case=lower,
        tokenizer_path=tokenizer, weights_path=weights_path, weights_format=weights_format, trust_pickle=trust_pickle,
    )


def encoder_spec(info: EncoderInfo) -> ModelSpec:
    """Token ids + mask (+ token types) of any batch and length in, one float32 embedding per text out."""
    inputs = [TensorSpec(name=name, dtype="int64", shape=["batch", "sequence"]) for name in info.input_names()]
    return ModelSpec(
        inputs=inputs,
        outputs=[TensorSpec(name="embedding", dtype="float32", shape=["batch", info.hidden_size])],
        task="embedding",
        family="text-embedding",
        # The text family's input preparation: what the server needs to turn strings into these inputs.
        preprocessing={"tokenizer": str(info.tokenizer_path), "max_length": info.max_seq_length,
                       "lowercase": info.do_lower_case, "pad_id": info.pad_token_id},
        extra={
            "model_type": info.model_type,
            "hidden_size": info.hidden_size,
            "num_heads": int(json.loads((info.model_folder / "config.json").read_text()).get("num_attention_heads") or 0),
            "tokenizer": str(info.tokenizer_path),
            "max_seq_length": info.max_seq_length,
            "max_positions": info.max_positions,
            "pooling": info.pooling,
            "pooling_source": info.pooling_source,
            "normalize": info.normalize,
            "do_lower_case": info.do_lower_case,
            "pad_token_id": info.pad_token_id,
            "vocab_size": info.vocab_size,
        },
    )


# --------------------------------------------------------------------------------------------- the torch module


def _build_sentence_encoder_class() -> type:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class SentenceEncoder(nn.Module):
        """A transformers ``AutoModel`` plus pooling and optional L2 normalization: ids in, sentence embedding out.

        ``forward`` branches only on settings fixed at construction (never on tensor values), so
        ``torch.export``, the ONNX exporters and ``torch.compile`` see one graph for every batch and length.
        """

        def __init__(self, model: nn.Module, pooling: str = "mean", normalize: bool = False, uses_token_type_ids: bool = True):
            super().__init__()
            if pooling not in POOLING_MODES:
                raise UserError(f"unknown pooling {pooling!r}", fix="use one of " + ", ".join(POOLING_MODES))
            self.model = model
            self.pooling = pooling
            self.normalize = normalize
            self.uses_token_type_ids = uses_token_type_ids

        @classmethod
        def from_folder(
            cls, folder: str | Path | EncoderInfo, *, trust_pickle: bool = False, attn_implementation: str | None = None
        ) -> SentenceEncoder:
            """Load with ``AutoModel.from_pretrained`` (local files only, float32) in eval mode.

            ``attn_implementation``: None lets transformers choose (``sdpa`` where the family has it);
            ``"eager"`` gives a plainer ONNX graph. Both export; see ``servopt.export.export_onnx``.
            """
            from transformers import AutoModel

            info = folder if isinstance(folder, EncoderInfo) else inspect_encoder(folder, trust_pickle=trust_pickle)
            if info.weights_path is None:
                raise UserError(f"{info.model_folder} has no PyTorch weights (model.safetensors)",
                                fix="load its ONNX file instead, or save the model with save_pretrained")
            kwargs: dict[str, Any] = {"local_files_only": True, "dtype": torch.float32, "output_loading_info": True}
            if attn_implementation:
                kwargs["attn_implementation"] = attn_implementation
            if info.weights_format == "safetensors":
                kwargs["use_safetensors"] = True  # never fall back to a pickle lying next to it
            elif not (trust_pickle or info.trust_pickle):
                raise UserError(f"{info.weights_path} is a pickle", fix="pass --trust-pickle, or convert it to safetensors")
            try:
                model, loading = AutoModel.from_pretrained(str(info.model_folder), **kwargs)
            except UserError:
                raise
            except Exception as e:
                raise UserError(
                    f"transformers could not load {info.model_folder} ({type(e).__name__}: {str(e).splitlines()[0][:300]})",
                    fix="check that the folder loads with transformers.AutoModel.from_pretrained",
                ) from e
            missing = [k for k in loading.get("missing_keys", []) if k.split(".", 1)[0] != "pooler" and ".pooler." not in k]
            if missing:
                raise UserError(
                    f"{info.weights_path.name} lacks {len(missing)} parameter(s) the model needs "
                    f"({', '.join(missing[:4])}{'…' if len(missing) > 4 else ''}): they would be random",
                    fix="the weights do not match config.json: restore both from the original model",
                )
            if getattr(model, "pooler", None) is not None:
                model.pooler = None  # the [CLS] dense+tanh head: unused by sentence-transformers, dead weight in exports
            model.eval().requires_grad_(False)
            # eval() on the wrapper too: a wrapper left in training mode makes the TorchScript exporter's
            # "restore the training flag" step switch the inner model (and its dropout) back on after export.
            return cls(model, info.pooling, info.normalize, info.uses_token_type_ids).eval()

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None):
            kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if self.uses_token_type_ids:
                kwargs["token_type_ids"] = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            hidden = self.model(**kwargs)[0].float()  # last_hidden_state [batch, sequence, hidden]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            elif self.pooling == "max":
                pooled = torch.where(mask > 0, hidden, torch.full_like(hidden, -1e9)).amax(dim=1)
            else:
                summed = (hidden * mask).sum(dim=1)
                count = mask.sum(dim=1).clamp(min=1e-9)
                pooled = summed / (count if self.pooling == "mean" else count.sqrt())
            if self.normalize:
                pooled = F.normalize(pooled, p=2.0, dim=1)
            return pooled

    SentenceEncoder.__module__ = __name__
    SentenceEncoder.__qualname__ = "SentenceEncoder"
    return SentenceEncoder


def __getattr__(name: str) -> Any:
    """``SentenceEncoder`` is defined on first access, so that importing this module does not import torch."""
    if name == "SentenceEncoder":
        cls = _build_sentence_encoder_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_sentence_encoder(
    folder: str | Path | EncoderInfo, *, trust_pickle: bool = False, attn_implementation: str | None = None
):
    """The eval-mode ``SentenceEncoder`` of a folder (see ``SentenceEncoder.from_folder``)."""
    return __getattr__("SentenceEncoder").from_folder(folder, trust_pickle=trust_pickle, attn_implementation=attn_implementation)
