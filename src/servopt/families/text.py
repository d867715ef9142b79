"""Sentence encoders (MiniLM, MPNet, BERT, BGE, E5): texts in, one embedding per text out, judged by the embeddings.

Data: a text file (one text per line), JSONL or CSV (``--texts``, ``--column``)
and optional scored pairs (``--pairs``, the STS-benchmark layout too), tokenized
with the model's own ``tokenizer.json`` (the ``tokenizers`` library: no torch).
Three texts in four are the evaluation set, the fourth the tuning set
(calibration, the accuracy-aware search); a seeded quarter of the pairs tunes
and the rest are judged on the evaluation side, held out from every choice.
Without texts, the sentences servopt ships are used, and the report says so.

Judgement against the original: cosine similarity of each embedding (mean,
minimum, 1st percentile), top-10 retrieval agreement (overlap of each text's
nearest neighbours), and Spearman correlation of cosine with the pair scores.
Server: OIP v2 with a ``BYTES`` input ``text`` (tokenized in the server),
``POST /v2/models/{name}/embed``, and OpenAI's ``POST /v1/embeddings``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from pydantic import Field

from servopt.contracts import Agreement, EmbeddingQuality, Gate, PairsQuality, Quality, Record
from servopt.data.dataset import Dataset, holdout_split
from servopt.data.text import DEMO_PAIRS, DEMO_SENTENCES, TextTokenizer, batching_waste, read_pairs, read_texts, spearman
from servopt.data.text import token_length_stats as length_stats
from servopt.errors import UserError
from servopt.families.base import BoundCheck, DataOptions, EmbeddingBase, LengthBatches, register_family
from servopt.families.catalogue import (
    LAB,
    NO_BF16,
    NO_FP16,
    TUNED,
    CatalogueContext,
    Variant,
    asking_precision,
    dynamic_int8,
    gpu_variants,
    nncf_onnx,
    openvino_float,
    ort_reference,
    ortep_openvino,
    static,
    when,
)
from servopt.families.metrics import agreement, cosine, paired_spearman_drop
from servopt.spec import ModelSpec, TensorSpec

TUNING_EVERY = 4  # every 4th text tunes (calibration, the accuracy-aware search); the other three evaluate
RETRIEVAL_K = 10
# A text is cut to this many characters per allowed token before tokenizing: beyond it no character can reach the
# model, and a 1 MB string costs the server nothing more than a long sentence.
CHARS_PER_TOKEN_CAP = 32


class TextDataOptions(DataOptions):
    texts: Path | None = Field(None, description="text encoders: texts, one per line (.txt), or .jsonl/.csv with --column")
    column: str | None = Field(None, description="the JSONL key / CSV column with the text (default: text)")
    pairs: Path | None = Field(None, description="text encoders: scored pairs (text_a, text_b, score; STS-benchmark TSV too)")


@lru_cache(maxsize=8)
def _tokenizer(path: str, max_length: int, lowercase: bool) -> TextTokenizer:
    return TextTokenizer(path, max_length, lowercase=lowercase)


def tokenizer_of(spec: ModelSpec) -> TextTokenizer:
    pp = spec.preprocessing or {}
    if not pp.get("tokenizer"):
        raise UserError("this text model has no tokenizer recorded", fix="load it from its Hugging Face folder")
    return _tokenizer(str(pp["tokenizer"]), int(pp.get("max_length") or 512), bool(pp.get("lowercase")))


def text_encoder(spec: ModelSpec, session: Any) -> Callable[[list[str], int], np.ndarray]:
    """Texts in, embeddings out, as servopt runs a text model offline: its tokenizer (the server's), length-sorted
    batches of ``batch_size`` each padded to its own longest text, results put back in input order. What a benchmark
    times against a peer's own ``encode(texts, batch_size)``."""
    from servopt.data.text import length_sorted_batches, pad_batch

    tok = tokenizer_of(spec)
    names = [t.name for t in spec.inputs]
    cap = tok.max_length * CHARS_PER_TOKEN_CAP

    def encode(texts: list[str], batch_size: int) -> np.ndarray:
        enc = tok.encode([t[:cap] for t in texts])
        if len(enc) <= batch_size:
            return session.run(pad_batch(enc, names, pad_id=tok.pad_id))
        lengths = np.fromiter((len(e.ids) for e in enc), dtype=np.int64, count=len(enc))
        out = None
        for idx in length_sorted_batches(lengths, batch_size):
            y = session.run(pad_batch([enc[i] for i in idx], names, pad_id=tok.pad_id))
            if out is None:
                out = np.empty((len(enc), *y.shape[1:]), dtype=y.dtype)
            out[idx] = y
        return out

    return encode


def split_pairs(pairs: list[tuple[str, str, float]]) -> tuple[list[tuple[str, str, float]], list[tuple[str, str, float]]]:
    """(tuning pairs, held-out pairs): a seeded quarter tunes, in the file's order on each side; fewer than
    ``TUNING_EVERY`` pairs are all held out."""
    tune, held = holdout_split(np.zeros(len(pairs), dtype=np.int64), 1 / TUNING_EVERY)
    return [pairs[i] for i in tune], [pairs[i] for i in held]


def _rows_with_pairs(spec: ModelSpec, texts: list[str], pairs: list[tuple[str, str, float]], source: str) -> Dataset:
    """The texts and the pairs' texts (each once) tokenized, with the pairs as indices into them and their scores."""
    given = set(texts)
    rows = texts + [t for t in dict.fromkeys(t for a, b, _ in pairs for t in (a, b)) if t not in given]
    if not rows:
        raise UserError("no texts to evaluate on", fix="pass --texts FILE (one text per line) and/or --pairs FILE")
    data = _rows(spec, rows, source)
    if pairs:
        index = {t: i for i, t in enumerate(rows)}
        data.extras = {"pair_a": np.array([index[a] for a, _, _ in pairs]), "pair_b": np.array([index[b] for _, b, _ in pairs]),
                       "pair_score": np.array([s for _, _, s in pairs], dtype=np.float64)}
    return data


def _rows(spec: ModelSpec, texts: list[str], source: str) -> Dataset:
    """Texts tokenized into the model's inputs, padded to the longest, with each text's real length."""
    tok = tokenizer_of(spec)
    cap = tok.max_length * CHARS_PER_TOKEN_CAP
    encoded = tok.encode([t[:cap] for t in texts])
    from servopt.data.text import pad_batch

    names = [t.name for t in spec.inputs]
    inputs = pad_batch(encoded, names, pad_id=tok.pad_id)
    lengths = np.array([len(e.ids) for e in encoded], dtype=np.int64)
    stats = length_stats([e.full_length for e in encoded], [e.truncated for e in encoded])
    meta = {"tokens": {**stats, "max_length": tok.max_length}, "padding_waste_b32": batching_waste(lengths, 32)}
    return Dataset(inputs, None, None, source, lengths=lengths, meta=meta)


@register_family
class TextEmbedding(EmbeddingBase):
    torch_serving = ("torch", "numpy", "transformers", "safetensors", "tokenizers")
    serving_files = ("tokenizer",)
    serving_requirements = ("tokenizers",)
    name = "text-embedding"
    DataOptions = TextDataOptions
    convenience_route = "embed"
    convenience_media_types = ("application/json", "")
    convenience_accepts = 'JSON: {"texts": ["…", …]}'
    convenience_body = "json"
    sweep_grid = ((1, 16), (1, 128), (32, 16), (32, 128))
    bench_grid = tuple((b, n) for b in (1, 8, 32) for n in (16, 64, 128, 256))
    no_data_note = "no --texts: servopt's shipped sample sentences and pairs are used (pass --texts/--pairs for your own)"

    def has_data(self, options: TextDataOptions) -> bool:
        return options.texts is not None or options.pairs is not None

    def catalogue(self, ctx: CatalogueContext) -> list[Variant]:
        """What the lab compares (eval / no_grad / inference_mode, torch.compile modes, dynamic INT8, bf16/fp16 autocast,
        ONNX export with dynamic batch and sequence, ORT online vs offline and its transformer optimizer, dynamic and
        static INT8, OpenVINO fp32/bf16/INT8), for any encoder; judged by the embeddings. The lab's ladder (plain, eval,
        no_grad, compile) is the ``lab`` group: measured with ``--lab``, never needed to answer a target."""
        cpu, export, drop = ctx.cpu, ctx.export, ctx.accuracy_drop
        # ONNX Runtime's transformer optimizer recognises attention in the TorchScript exporter's graph of eager
        # attention (the dynamo graph fuses only BiasGelu): that chain exports that way.
        fusable = [("export-onnx", {"exporter": "torchscript", "attention": "eager"})] if ctx.is_torch else []
        fused = [*fusable, ("ort-transformers-optimize", {})]
        # dynamic INT8 with s8 weights in 7 bits where this CPU's U8S8 kernel saturates (catalogue.dynamic_int8)
        def dyn(**params) -> tuple[str, dict]:
            return dynamic_int8(ctx.int8_cpu, **params)
        s8 = ("S8 weights in 7 bits (no VNNI here or on a target: U8S8 would saturate)" if ctx.int8_cpu.int8_saturates
              else "S8 weights")

        act = "S8" if cpu.int8_signed else "U8"  # ONNX Runtime's fast static INT8 on this CPU (see CpuFeatures.int8_signed)
        lab = LAB
        no_vnni = "static INT8 of activations needs 8-bit dot products (VNNI) to pay on transformers"
        v: list[Variant] = []
        if ctx.is_torch:
            v += [
                Variant("torch-eager", "pytorch", "torch", description="PyTorch eval() + inference_mode (the original)", role="original"),
                Variant("torch-plain", "lab", "torch", options={"grad_mode": "plain"}, gate=False, **lab,
                        description="the module as a notebook calls it: training mode (dropout on), autograd on; measured as "
                                    "the baseline, never chosen (dropout changes its embeddings)"),
                Variant("torch-eval", "lab", "torch", options={"grad_mode": "eval"}, description="eval(), autograd on", **lab),
                Variant("torch-no-grad", "lab", "torch", options={"grad_mode": "no_grad"}, description="eval() + no_grad", **lab),
                Variant("torch-compile", "lab", "torch", options={"compile": "default", "compile_dynamic": True}, env=TUNED, **lab,
                        description="torch.compile, dynamic shapes (no recompile per length); compile time counts as cold start"),
                Variant("torch-compile-max-autotune", "lab", "torch", options={"compile": "max-autotune", "compile_dynamic": True},
                        env=TUNED, default=False, left_out_why="minutes of autotuning: opt in",
                        description="torch.compile max-autotune, dynamic shapes"),
                Variant("torch-compile-max-autotune-no-cudagraphs", "lab", "torch",
                        options={"compile": "max-autotune-no-cudagraphs", "compile_dynamic": True}, env=TUNED, default=False,
                        left_out_why="minutes of autotuning: opt in", description="torch.compile max-autotune-no-cudagraphs"),
                Variant("torch-int8-dynamic", "pytorch", "torch", chain=[("torch-quantize-dynamic", {})],
                        options={"quantize_dynamic": True}, description="torch.ao dynamic INT8 of nn.Linear (state_dict size on disk measured)"),
                Variant("torch-bf16-autocast", "pytorch", "torch", options={"dtype": "bf16", "autocast": True},
                        description="torch.autocast(bf16) over fp32 weights", **when(cpu.bf16, NO_BF16)),
                Variant("torch-fp16-autocast", "pytorch", "torch", options={"dtype": "fp16", "autocast": True},
                        description="torch.autocast(fp16) over fp32 weights", **when(cpu.fp16, NO_FP16)),
            ]
        v += [
            ort_reference(ctx, "ONNX Runtime defaults, graph optimized online at load (the reference every ratio is taken against)"),
            Variant("ort-offline-all", "onnxruntime", "onnxruntime", [*export, ("ort-graph-offline", {"level": "all"})],
                    {"graph_optimization_level": "disable"}, description="graph optimized offline, loaded with optimizations off (faster cold start)"),
            Variant("ort-transformers", "onnxruntime", "onnxruntime", fused,
                    description="ONNX Runtime's transformer optimizer: attention, LayerNorm, GELU fusions (which applied: build report)"),
            Variant("ort-int8-dynamic", "int8", "onnxruntime", [*export, dyn()], description=f"ORT dynamic INT8, {s8} per tensor"),
            Variant("ort-int8-dynamic-per-channel", "int8", "onnxruntime", [*export, dyn(per_channel=True)],
                    description=f"ORT dynamic INT8, {s8} per channel"),
            Variant("ort-int8-dynamic-u8", "int8", "onnxruntime", [*export, dyn(weight_type="U8")],
                    description="ORT dynamic INT8, U8 weights"),
            Variant("ort-transformers-int8-dynamic", "int8", "onnxruntime", [*fused, dyn(per_channel=True)],
                    description=f"transformer-optimized graph, then dynamic INT8 ({s8} per channel)"),
            # all-mpnet-base-v2 loses most of its dynamic INT8 cosine (0.89) in the FFN output projections of its middle
            # layers (GELU's long tail); those in float: 0.991, still 1.6x fp32's batch throughput (docs/text.md)
            Variant("ort-int8-dynamic-ffn-float", "int8", "onnxruntime",
                    [*export, dyn(per_channel=True, float_ffn_output=True, op_types=["MatMul"])],
                    refines="ort-int8-dynamic-per-channel", same_kernels=False,
                    description=f"ORT dynamic INT8 of the MatMuls ({s8} per channel), the FFN output projections kept in float"),
            Variant("ort-int8-static-qdq", "int8", "onnxruntime", [*export, ("ort-quantize-static", static("QDQ", act, "S8"))],
                    description=f"static INT8 QDQ {act}S8 per channel, calibrated on the tuning texts", **when(cpu.int8_dot, no_vnni)),
            Variant("ort-int8-nncf", "int8", "onnxruntime",
                    [*export, nncf_onnx(ctx.int8_cpu, model_type="transformer", preset="mixed")],
                    description="NNCF post-training INT8 on the ONNX graph, transformer rules (SmoothQuant), QDQ run by ONNX Runtime",
                    **when(cpu.int8_dot, no_vnni)),
            Variant("ort-int8-accuracy-aware", "int8", "onnxruntime",
                    [*fused, ("ort-quantize-accuracy-aware", {"mode": "dynamic", "per_channel": True, "max_drop": drop,
                                                              "reduce_range": ctx.int8_cpu.int8_saturates})],
                    refines="ort-transformers-int8-dynamic", same_kernels=False,
                    description=f"as much dynamic INT8 as keeps mean cosine within {drop / 100:.3g} of the original; the fastest mix"),
            Variant("ort-fp16", "fp16", "onnxruntime", [*export, ("fp16", {})],
                    description="FP16 weights, half the size" + ("" if cpu.fp16 else "; no fp16 arithmetic here: computed through casts")),
            *openvino_float(ctx),
            *ortep_openvino(ctx),
            # NNCF's own overflow fix (first layer) here even for a CPU without VNNI: on emulated AVX2 kernels the
            # MiniLM demo's kept its Spearman (0.9246 against 0.9243 on a VNNI Zen 4, cosine to fp32 0.9953), where
            # the fix on every layer fell below the cosine gate (0.9890) on the Zen 4 (docs/hardware.md)
            Variant("nncf-int8-latency", "openvino", "openvino", [*export, ("nncf-quantize", {"model_type": "transformer"})],
                    {"hint": "LATENCY"}, description="NNCF INT8 with the transformer model type, OpenVINO LATENCY hint"),
            Variant("nncf-int8-throughput", "openvino", "openvino", [*export, ("nncf-quantize", {"model_type": "transformer"})],
                    {"hint": "THROUGHPUT"}, description="NNCF INT8 with the transformer model type, OpenVINO THROUGHPUT hint"),
            *gpu_variants(ctx),
        ]
        return asking_precision(v)

    def _texts(self, options: TextDataOptions) -> tuple[list[str], list[tuple[str, str, float]], str]:
        if not self.has_data(options):
            return read_texts(DEMO_SENTENCES), read_pairs(DEMO_PAIRS), "servopt's shipped sample sentences and pairs"
        texts = read_texts(options.texts, options.column) if options.texts else []
        pairs = read_pairs(options.pairs) if options.pairs else []
        return texts, pairs, str(options.texts or options.pairs)

    def _eval_side(self, options: TextDataOptions) -> tuple[list[str], list[tuple[str, str, float]], str]:
        """The held-out texts and pairs: three texts in four, and the pairs ``split_pairs`` does not tune on."""
        texts, pairs, source = self._texts(options)
        held = [t for i, t in enumerate(texts) if i % TUNING_EVERY != TUNING_EVERY - 1] if len(texts) >= TUNING_EVERY else texts
        if options.limit is not None:
            held = held[:options.limit]
        return held, split_pairs(pairs)[1], source

    def read_eval(self, spec: ModelSpec, options: TextDataOptions) -> tuple[Dataset, ModelSpec]:
        held, pairs, source = self._eval_side(options)
        data = _rows_with_pairs(spec, held, pairs, source)
        data.meta["texts"] = len(held)
        data.meta["pairs"] = len(pairs)
        data.meta["split"] = (f"held out from every choice: three texts in {TUNING_EVERY} and the pairs a seeded quarter "
                              "did not take (that quarter and the fourth text tune)")
        return data, spec

    def read_tuning(self, spec: ModelSpec, options: TextDataOptions) -> tuple[Dataset, list[str]]:
        """The fourth text and a quarter of the pairs (their texts, and their scores to judge on); a text the
        evaluation side also holds is left out, so no choice sees a held-out text."""
        texts, pairs, _ = self._texts(options)
        notes = [] if self.has_data(options) else ["no --texts: servopt's shipped sample sentences and pairs are used"]
        held, held_pairs, _ = self._eval_side(options)
        seen = set(held) | {t for a, b, _ in held_pairs for t in (a, b)}
        tuning = [t for i, t in enumerate(texts) if i % TUNING_EVERY == TUNING_EVERY - 1 and t not in seen]
        tuning_pairs = [p for p in split_pairs(pairs)[0] if p[0] not in seen and p[1] not in seen]
        if not tuning and not tuning_pairs:
            notes.append(f"fewer than {TUNING_EVERY} texts and {TUNING_EVERY} pairs: tuning uses the evaluation texts, "
                         "so the quality verdict is optimistic")
            return _rows_with_pairs(spec, held, held_pairs, "tuning"), notes
        return _rows_with_pairs(spec, tuning, tuning_pairs, "tuning"), notes

    def synthetic(self, spec: ModelSpec, count: int = 64, seed: int = 0) -> Dataset:
        return _rows(spec, read_texts(DEMO_SENTENCES)[:count], "servopt's shipped sample sentences")

    def collate(self, feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Requests of different lengths into one batch, each padded to the longest of the batch (pad id 0 is
        masked out, so its value does not matter)."""
        if len(feeds) == 1:
            return feeds[0]
        # Filled in place: np.pad is ~40 µs per array in Python, 1.5 ms for a batch of 12 one-text requests, all of it
        # holding the GIL in the inference thread.
        width = max(f["attention_mask"].shape[1] for f in feeds)
        rows = sum(len(f["attention_mask"]) for f in feeds)
        out = {n: np.zeros((rows, width), feeds[0][n].dtype) for n in feeds[0]}
        row = 0
        for f in feeds:
            size, length = f["attention_mask"].shape
            for n, a in out.items():
                a[row:row + size, :length] = f[n]
            row += size
        return out

    def grid_feed(self, data: Dataset, batch: int, length: int) -> dict[str, np.ndarray] | None:
        """Real token ids (the evaluation texts' own, repeated to fill ``length``), every row ``length`` long."""
        ids = data.inputs["input_ids"]
        real = np.concatenate([ids[i, 1:max(2, int(n) - 1)] for i, n in enumerate(data.lengths)]) if data.lengths is not None \
            else ids.reshape(-1)
        body = np.resize(real, (batch, max(1, length - 2)))
        first, last = ids[0, 0], ids[0, int(data.lengths[0]) - 1] if data.lengths is not None else ids[0, -1]
        full = np.concatenate([np.full((batch, 1), first), body, np.full((batch, 1), last)], axis=1)[:, :length]
        feed = {"input_ids": full.astype(np.int64), "attention_mask": np.ones_like(full, dtype=np.int64),
                "token_type_ids": np.zeros_like(full, dtype=np.int64)}
        return {n: feed[n] for n in data.inputs}

    def length_batches(self, data: Dataset, batch_size: int) -> LengthBatches | None:
        if data.lengths is None:
            return None
        from servopt.data.text import first_come_batches, length_sorted_batches, padding_waste

        fc, st = first_come_batches(len(data), batch_size), length_sorted_batches(data.lengths, batch_size)
        return LengthBatches(first_come=[data.rows(b) for b in fc], sorted=[data.rows(b) for b in st],
                             first_come_waste=padding_waste(fc, data.lengths), sorted_waste=padding_waste(st, data.lengths),
                             real_tokens=int(data.lengths.sum()))

    def judge(self, outputs: np.ndarray, data: Dataset, reference: np.ndarray | None) -> EmbeddingQuality:
        agr: Agreement | None = None
        if reference is not None:
            agr = agreement(outputs, reference, task="embedding")
            if agr.error is None:
                agr.retrieval_top10 = retrieval_agreement(outputs, reference, RETRIEVAL_K)
        pairs = None
        if "pair_a" in data.extras:
            a, b, gold = data.extras["pair_a"], data.extras["pair_b"], data.extras["pair_score"]
            mine = cosine(outputs[a], outputs[b])
            pairs = PairsQuality(spearman=spearman(mine, gold), pairs=len(gold))
            if agr is not None and agr.error is None and reference is not None and len(gold) > 1:
                theirs = cosine(reference[a], reference[b])  # the same pairs, the original's similarities: a paired drop
                low, high = paired_spearman_drop(theirs, mine, gold)
                pairs = pairs.model_copy(update={"drop_points": (spearman(theirs, gold) - pairs.spearman) * 100,
                                                 "drop_low": low * 100, "drop_high": high * 100})
        return EmbeddingQuality(agreement=agr, pairs=pairs)

    def gate_failure(self, quality: Quality, gate: Gate) -> str | None:
        agr = getattr(quality, "agreement", None)
        if agr and agr.error:
            return agr.error
        if agr and gate.min_cosine is not None and agr.cosine_mean is not None and agr.cosine_mean < gate.min_cosine:
            return f"mean cosine similarity to the original {agr.cosine_mean:.4f} < {gate.min_cosine}"
        # The bound is on a mean, so it is held to means here too: served alone, and alone vs batched (the lowest is
        # reported). A single text far off its batched self is what `cosine_min` and `batch_consistency_min` show.
        if agr and gate.min_cosine is not None and agr.cosine_mean_alone is not None and agr.cosine_mean_alone < gate.min_cosine:
            return (f"texts run alone (as a server sends a lone request) have mean cosine {agr.cosine_mean_alone:.4f} to the "
                    f"original (< {gate.min_cosine}); in padded batches {agr.cosine_mean:.4f}")
        if agr and gate.min_cosine is not None and agr.batch_consistency is not None and agr.batch_consistency < gate.min_cosine:
            low = "" if agr.batch_consistency_min is None else f"; lowest {agr.batch_consistency_min:.4f}"
            return (f"a text's embedding depends on what it is batched with: mean cosine {agr.batch_consistency:.4f} alone vs in "
                    f"a padded batch (< {gate.min_cosine}{low}); a server's batcher would change its answers")
        return None

    def gate_shortfall(self, quality: Quality, gate: Gate) -> float | None:
        agr = getattr(quality, "agreement", None)
        if not agr or agr.error or gate.min_cosine is None or gate.min_cosine >= 1:
            return None
        means = [m for m in (agr.cosine_mean, agr.cosine_mean_alone, agr.batch_consistency) if m is not None]
        return None if not means else max(0.0, gate.min_cosine - min(means)) / (1 - gate.min_cosine)

    def quality_drop(self, record: Record, reference: Record | None) -> float | None:
        """Points of Spearman lost on the pairs where there are pairs, else (1 − mean cosine) in points."""
        mine, theirs = getattr(record.quality, "pairs", None), getattr(reference.quality, "pairs", None) if reference else None
        if mine and theirs:
            return (theirs.spearman - mine.spearman) * 100
        return super().quality_drop(record, reference)

    def quality_bounds(self, target: Any, record: Record, reference: Record | None) -> list[BoundCheck]:
        checks = super().quality_bounds(target, record, reference)
        if target.max_spearman_drop is not None:
            mine, theirs = getattr(record.quality, "pairs", None), getattr(reference.quality, "pairs", None) if reference else None
            drop = (theirs.spearman - mine.spearman) * 100 if mine and theirs else None
            checks.append(BoundCheck("spearman_drop_points", target.max_spearman_drop, drop, True, "Spearman on the scored pairs"))
        return checks

    def sequence_length(self, feed: dict[str, np.ndarray]) -> int | None:
        return int(feed["attention_mask"].shape[1]) if "attention_mask" in feed else None

    # serving: strings in, tokenized here ----------------------------------------------------------------------
    def served_inputs(self, spec: ModelSpec) -> list[TensorSpec]:
        return [TensorSpec(name="text", dtype="object", shape=["batch"])]

    def model_inputs(self, spec: ModelSpec, inputs: dict[str, np.ndarray], params: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
        """Strings (``text``) tokenized; or the model's own token inputs, checked (``check_token_inputs``)."""
        if "text" not in inputs:
            feed = check_token_inputs(spec, inputs)
            return feed, {"tokens": int(feed["attention_mask"].sum()) if "attention_mask" in feed else int(feed["input_ids"].size)}
        raw = inputs["text"].reshape(-1)
        texts = [_decode(x, i) for i, x in enumerate(raw)]
        return self.tokenize(spec, texts, truncate=params.get("truncate", True) is not False)

    def tokenize(self, spec: ModelSpec, texts: list[str], truncate: bool = True) -> tuple[dict[str, np.ndarray], dict]:
        """Model inputs for ``texts`` and what tokenizing found (tokens, truncated texts). With ``truncate=False`` a
        text over the model's limit is refused instead of cut."""
        tok = tokenizer_of(spec)
        cap = tok.max_length * CHARS_PER_TOKEN_CAP
        feed, lengths, cut = tok.encode_padded([t[:cap] for t in texts], [t.name for t in spec.inputs])
        if cut and not truncate:
            first = min(cut)
            raise UserError(f"{len(cut)} text(s) are longer than the model's {tok.max_length} tokens (first: #{first}, "
                            f"{cut[first]} tokens)", fix="shorten them, or allow truncation (the default)")
        return feed, {"tokens": int(sum(lengths)), "truncated": len(cut)}

    def convenience_inputs(self, spec: ModelSpec, body: Any, max_pixels: int) -> dict[str, np.ndarray]:
        texts = body.get("texts") if isinstance(body, dict) else None
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise UserError('the body needs "texts": a non-empty list of strings', fix='e.g. {"texts": ["a sentence"]}')
        return self.tokenize(spec, texts)[0]

    def convenience_output(self, spec: ModelSpec, output: np.ndarray, params: dict[str, Any]) -> dict[str, Any]:
        return {"embeddings": output.astype(np.float32).tolist(), "dimensions": int(output.shape[1])}


class TokenBounds(NamedTuple):
    """What raw token inputs must stay within for this model: ids index its embedding tables, so an id past a table
    is a runtime error inside the model (failing every request batched with it), not a wrong answer."""

    vocab: int  # input_ids in [0, vocab)
    types: int  # token_type_ids in [0, types)
    max_length: int  # tokens per text
    source: str  # where the sizes were read


def _sizes_from_tokenizer(path: Path) -> tuple[int | None, int | None]:
    """(vocabulary with added tokens, token types its post-processor writes) of a tokenizer.json."""
    import json

    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
        doc = json.loads(path.read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is reported where it tokenizes
        return None, None

    def type_ids(node: Any) -> list[int]:
        if isinstance(node, dict):
            found = [node["type_id"]] if isinstance(node.get("type_id"), int) else []
            return found + [t for v in node.values() for t in type_ids(v)]
        return [t for v in node for t in type_ids(v)] if isinstance(node, list) else []

    post = doc.get("post_processor") if isinstance(doc, dict) else None
    types = 2 if isinstance(post, dict) and post.get("type") == "BertProcessing" else max(type_ids(post), default=0) + 1
    return vocab, types


@lru_cache(maxsize=8)
def _bounds(tokenizer: str, max_length: int, vocab: int | None, types: int | None) -> TokenBounds:
    """The sizes from every record at hand, the smallest winning: the model's config (``spec.extra``, or config.json
    beside the tokenizer, as a Hugging Face folder has it) and the tokenizer (its vocabulary; the token types its
    template writes, which is all a package carries)."""
    vocabs, type_sizes, sources = [v for v in (vocab,) if v], [t for t in (types,) if t], ["the model's config"] if vocab else []
    path = Path(tokenizer) if tokenizer else None
    if path is not None and path.is_file():
        config = path.with_name("config.json")
        if config.is_file():
            import json

            try:
                doc = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                doc = {}
            vocabs += [doc["vocab_size"]] if isinstance(doc.get("vocab_size"), int) else []
            type_sizes += [doc["type_vocab_size"]] if isinstance(doc.get("type_vocab_size"), int) else []
            sources.append(config.name)  # a file name: this text reaches clients, the server's paths must not
        tok_vocab, tok_types = _sizes_from_tokenizer(path)
        vocabs += [tok_vocab] if tok_vocab else []
        type_sizes += [tok_types] if tok_types else []
        sources.append(path.name)
    if not vocabs:
        raise UserError("this model records no vocabulary size to check raw token ids against",
                        fix="send texts (the 'text' input), or serve a model with its tokenizer.json")
    return TokenBounds(min(vocabs), max(1, min(type_sizes, default=1)), max_length, " and ".join(sources))


def token_bounds(spec: ModelSpec) -> TokenBounds:
    pp, extra = spec.preprocessing or {}, spec.extra or {}

    def size(key: str) -> int | None:
        v = extra.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    return _bounds(str(pp.get("tokenizer") or ""), int(pp.get("max_length") or 512), size("vocab_size"), size("type_vocab_size"))


def check_token_inputs(spec: ModelSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Raw token inputs checked against the model before it runs them: one shape for all, at least one and at most
    ``max_length`` tokens per text, ids inside the vocabulary and token types inside the type vocabulary, a mask
    of 0/1 — each refused with the bound named, never a runtime error. Token types the model takes but the request
    left out (OpenAI's token arrays) are zeros, as the tokenizer writes for a single text."""
    names = [t.name for t in spec.inputs]
    feed = dict(inputs)
    if "token_type_ids" in names and "token_type_ids" not in feed and "input_ids" in feed:
        feed["token_type_ids"] = np.zeros_like(feed["input_ids"])
    missing = [n for n in names if n not in feed]
    if missing:
        raise UserError(f"missing token input(s) {missing}", fix=f"send {names}, or texts as the 'text' input")
    shapes = {n: tuple(feed[n].shape) for n in names}
    if len(set(shapes.values())) != 1:
        raise UserError(f"token inputs disagree on their shape: {shapes}", fix="send every token input as [texts, tokens]")
    bounds = token_bounds(spec)
    width = next(iter(shapes.values()))[1]
    if width < 1:
        raise UserError("token inputs hold no tokens", fix="send at least one token per text ([CLS] [SEP] for an empty text)")
    if width > bounds.max_length:
        raise UserError(f"{width} tokens per text; the model takes at most {bounds.max_length}",
                        fix="truncate the token ids, or send texts (truncated by the server)")
    for name, limit, what in (("input_ids", bounds.vocab, "vocabulary"), ("token_type_ids", bounds.types, "token types")):
        if name not in names:
            continue
        low, high = int(feed[name].min()), int(feed[name].max())
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            raise UserError(f"{name} holds {bad}, outside the model's {what} [0, {limit}) (from {bounds.source})",
                            fix="send this model's own token ids (its tokenizer's), or texts as the 'text' input")
    if "attention_mask" in names and not np.isin(feed["attention_mask"], (0, 1)).all():
        raise UserError("attention_mask holds values other than 0 and 1", fix="1 for each real token, 0 for padding")
    return {n: feed[n] for n in names}


def _decode(item: Any, i: int) -> str:
    if isinstance(item, str):
        return item
    try:
        return bytes(item).decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"text #{i} is not valid UTF-8 (byte 0x{bytes(item)[e.start]:02x} at offset {e.start})",
                        fix="send UTF-8 text") from e


def retrieval_agreement(outputs: np.ndarray, reference: np.ndarray, k: int = RETRIEVAL_K) -> float:
    """Mean overlap of each text's ``k`` nearest neighbours (cosine, itself excluded) under the variant and under the
    original: 1.0 means a search index built on the variant returns the same results."""
    n = len(outputs)
    if n < 2:
        return 1.0
    k = min(k, n - 1)

    def neighbours(x: np.ndarray) -> np.ndarray:
        x = x.reshape(n, -1).astype(np.float64)
        x /= np.linalg.norm(x, axis=1, keepdims=True) + 1e-12
        sim = x @ x.T
        np.fill_diagonal(sim, -np.inf)
        return np.argsort(-sim, axis=1, kind="stable")[:, :k]

    a, b = neighbours(outputs), neighbours(reference)
    return float(np.mean([len(set(a[i]) & set(b[i])) / k for i in range(n)]))
