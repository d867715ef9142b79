"""Text for text encoders: reading texts and scored pairs, tokenizing, padding, length statistics, Spearman.

This module runs in the lean serving install, so it needs only the ``tokenizers``
library (Rust, no torch) and NumPy: the server tokenizes with exactly the code
the benchmark measured. Tokenizing pads nothing; ``pad_batch`` pads each batch to
its own longest text, because padding to a fixed length wastes most of the
compute on short texts (``padding_waste`` measures how much, and how much sorting
by length saves).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from servopt.errors import UserError

TEXT_FORMATS = (".txt", ".jsonl", ".csv", ".tsv")
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
DEMO_TEXT_DIR = Path(__file__).parent / "demo_text"
DEMO_SENTENCES = DEMO_TEXT_DIR / "sentences.txt"  # ~300 sentences, queries to paragraphs (some over 128 tokens)
DEMO_PAIRS = DEMO_TEXT_DIR / "pairs.tsv"  # ~120 scored pairs, STS-style 0–5

_PAD_TOKENS = ("[PAD]", "<pad>", "<|padding|>", "<|pad|>")
_TEXT_A = ("text_a", "sentence1", "sentence_a", "s1", "text1", "premise", "query")
_TEXT_B = ("text_b", "sentence2", "sentence_b", "s2", "text2", "hypothesis", "passage")
_SCORE = ("score", "label", "similarity", "gold", "relatedness")


# --------------------------------------------------------------------------------------------- reading


def _read_utf8(path: Path) -> str:
    """The file's text, with the line of the first undecodable byte in the error."""
    if not path.exists():
        raise UserError(f"text file {path} does not exist", fix="check the path")
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a text file", fix="pass a " + "/".join(TEXT_FORMATS) + " file")
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(
            f"{path} line {line} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})",
            fix="re-save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 in.txt > out.txt",
        ) from e


def _lines(text: str) -> list[str]:
    """Split on newlines only (``str.splitlines`` would also split inside texts on U+2028, form feeds, …)."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def read_texts(path: str | Path, column: str | None = None) -> list[str]:
    """Texts from ``.txt`` (one per line), ``.jsonl`` (``column``, default "text") or ``.csv``/``.tsv``
    (a header row; ``column`` by name, default "text", else the first column). Blank texts are skipped."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in TEXT_FORMATS:
        raise UserError(f"cannot read texts from {path.name}: servopt reads " + ", ".join(TEXT_FORMATS),
                        fix="save the texts as .txt (one per line), .jsonl or .csv/.tsv")
    text = _read_utf8(path)
    if suffix == ".txt":
        if column is not None:
            raise UserError(f"a column ({column!r}) was given but {path.name} is plain text, one text per line",
                            fix="drop the column, or use a .jsonl/.csv/.tsv file")
        texts = [line.strip() for line in _lines(text)]
    elif suffix == ".jsonl":
        texts = _jsonl_texts(path, text, column or "text")
    else:
        texts = _table_texts(path, text, column, "\t" if suffix == ".tsv" else ",")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UserError(f"{path} has no texts (it is empty or blank)", fix="point at a file with at least one text")
    return texts


def _jsonl_texts(path: Path, text: str, column: str) -> list[str]:
    out: list[str] = []
    for n, line in enumerate(_lines(text), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} line {n} is not JSON ({e.msg})", fix="write one JSON object per line") from e
        if isinstance(row, str):
            out.append(row)
            continue
        if not isinstance(row, dict):
            raise UserError(f"{path} line {n} is a JSON {type(row).__name__}, not an object", fix='write lines like {"text": "…"}')
        if column not in row:
            raise UserError(f"{path} line {n} has no {column!r} field (it has: {', '.join(map(str, row)) or 'none'})",
                            fix="name the field holding the text with --column")
        value = row[column]
        if not isinstance(value, str):
            raise UserError(f"{path} line {n}: {column!r} is not a string (it is {json.dumps(value)[:50]})",
                            fix="store the text as a JSON string")
        out.append(value)
    return out


def _table_texts(path: Path, text: str, column: str | None, delimiter: str) -> list[str]:
    rows = [r for r in csv.reader(io.StringIO(text, newline=""), delimiter=delimiter) if any(c.strip() for c in r)]
    if not rows:
        return []
    header = [h.strip() for h in rows[0]]
    if column is not None and column not in header:
        raise UserError(f"{path} has no column {column!r} (its columns: {', '.join(header)})",
                        fix="pass one of those names with --column")
    idx = header.index(column) if column is not None else (header.index("text") if "text" in header else 0)
    return [r[idx] if idx < len(r) else "" for r in rows[1:]]


def _is_float(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def read_pairs(path: str | Path) -> list[tuple[str, str, float]]:
    """Scored sentence pairs: ``text_a<TAB>text_b<TAB>score`` (CSV too; header optional, named columns honoured)
    or the STS-benchmark layout (genre, filename, year, id, score, sentence1, sentence2; tab-separated, no quoting)."""
    path = Path(path)
    text = _read_utf8(path)
    first = next((line for line in _lines(text) if line.strip()), "")
    tabbed = "\t" in first or path.suffix.lower() == ".tsv"
    # STS files contain bare quotes inside sentences: tab-separated files are read with quoting off, as the benchmark does.
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t" if tabbed else ",",
                        quoting=csv.QUOTE_NONE if tabbed else csv.QUOTE_MINIMAL)
    rows = [(reader.line_num, r) for r in reader if any(c.strip() for c in r)]
    if not rows:
        raise UserError(f"{path} has no pairs (it is empty)", fix="write one text_a<TAB>text_b<TAB>score line per pair")
    layouts = "text_a<TAB>text_b<TAB>score, or the STS-benchmark layout (genre, file, year, id, score, sentence1, sentence2)"
    _, head = rows[0]
    if len(head) >= 7:
        a, b, s = 5, 6, 4
    elif len(head) == 3:
        a, b, s = 0, 1, 2
    else:
        a = b = s = -1
    if s < 0 or not _is_float(head[s]):  # a header row: use its names when it has them
        names = [h.strip().lower() for h in head]
        found = [next((names.index(n) for n in aliases if n in names), -1) for aliases in (_TEXT_A, _TEXT_B, _SCORE)]
        if -1 not in found:
            a, b, s = found
        elif s < 0:
            raise UserError(f"{path} line {rows[0][0]} has {len(head)} columns; servopt reads {layouts}",
                            fix="rewrite the file in one of those layouts")
        rows = rows[1:]
    pairs: list[tuple[str, str, float]] = []
    for line, row in rows:
        if len(row) <= max(a, b, s):
            raise UserError(f"{path} line {line} has {len(row)} columns where {max(a, b, s) + 1} are needed ({layouts})",
                            fix="fix that line (a stray tab or a missing field)")
        if not _is_float(row[s]):
            raise UserError(f"{path} line {line}: the score {row[s]!r} is not a number", fix="fix that line")
        pairs.append((row[a].strip(), row[b].strip(), float(row[s])))
    if not pairs:
        raise UserError(f"{path} has a header but no pairs", fix="add text_a<TAB>text_b<TAB>score lines")
    return pairs


# --------------------------------------------------------------------------------------------- tokenizing


class TokenizedText(NamedTuple):
    ids: np.ndarray  # int64, special tokens included, at most max_length
    type_ids: np.ndarray  # int64, same length
    truncated: bool  # the full text has more than max_length tokens
    full_length: int  # tokens the text would have without truncation (special tokens included)


class TextTokenizer:
    """A ``tokenizer.json`` (Hugging Face fast tokenizer) truncating at ``max_length`` and padding nothing.

    Truncation and padding stored in the file are replaced: MiniLM's file, for one, pads every text to 128
    tokens and truncates at 128, while its model is meant to read 256.
    """

    def __init__(self, tokenizer_json: str | Path, max_length: int, *, lowercase: bool = False) -> None:
        from tokenizers import Tokenizer

        path = Path(tokenizer_json)
        if not path.is_file():
            raise UserError(f"tokenizer file {path} does not exist",
                            fix="save a fast tokenizer: AutoTokenizer.from_pretrained(model).save_pretrained(folder)")
        if max_length < 2:
            raise UserError(f"max_length {max_length} leaves no room for a text", fix="use the model's max_seq_length")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exceptions
            raise UserError(f"{path} is not a readable tokenizer.json ({e})", fix="save the tokenizer again") from e
        self.path = path
        self.max_length = int(max_length)
        self.lowercase = lowercase
        padding = self._tok.padding
        if padding and padding.get("pad_id") is not None:
            self.pad_id = int(padding["pad_id"])
        else:
            self.pad_id = next((i for t in _PAD_TOKENS if (i := self._tok.token_to_id(t)) is not None), 0)
        self._tok.no_padding()
        self._tok.enable_truncation(self.max_length, stride=0, strategy="longest_first", direction="right")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, texts: Sequence[str]) -> list[TokenizedText]:
        """Tokenize in one Rust batch call (parallel across texts); each result says whether it was truncated."""
        texts = list(texts)
        if self.lowercase:
            texts = [t.lower() for t in texts]
        out: list[TokenizedText] = []
        for enc in self._tok.encode_batch(texts):
            full = len(enc.ids)
            if enc.overflowing:  # the rest of the text, each chunk with its own special tokens around it
                full += sum(len(o.ids) - sum(o.special_tokens_mask) for o in enc.overflowing)
            out.append(TokenizedText(
                np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.type_ids, dtype=np.int64),
                bool(enc.overflowing), full,
            ))
        return out

    def encode_padded(self, texts: Sequence[str], names: Sequence[str] = INPUT_NAMES[:2]
                      ) -> tuple[dict[str, np.ndarray], list[int], dict[int, int]]:
        """Tokenize and pad in one pass (the server's path): the model inputs ``pad_batch(encode(texts), names)``
        gives, each text's token count, and the full length of every text cut at ``max_length`` (by its index).
        Filled straight from the Rust batch's encodings, without arrays and tuples per text: half the CPU of the
        two steps for a one-sentence request."""
        _check_names(names)
        texts = [t.lower() for t in texts] if self.lowercase else list(texts)
        if not texts:
            raise UserError("no texts to pad into a batch", fix="give at least one text")
        encodings = self._tok.encode_batch(texts)
        rows = [e.ids for e in encodings]
        lengths = [len(r) for r in rows]
        width = max(lengths)
        arrays: dict[str, np.ndarray] = {}
        if min(lengths) == width:  # one text, or texts of one length: no padding at all
            arrays["input_ids"] = np.array(rows, np.int64)
            arrays["attention_mask"] = np.ones((len(rows), width), np.int64)
            if "token_type_ids" in names:
                arrays["token_type_ids"] = np.array([e.type_ids for e in encodings], np.int64)
        else:
            ids, mask = np.full((len(rows), width), self.pad_id, np.int64), np.zeros((len(rows), width), np.int64)
            types = np.zeros((len(rows), width), np.int64)
            for row, (enc, r, n) in enumerate(zip(encodings, rows, lengths, strict=True)):
                ids[row, :n], mask[row, :n], types[row, :n] = r, 1, enc.type_ids
            arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        cut = {i: n + sum(len(o.ids) - sum(o.special_tokens_mask) for o in enc.overflowing)
               for i, (enc, n) in enumerate(zip(encodings, lengths, strict=True)) if enc.overflowing}
        return {n: arrays[n] for n in names}, lengths, cut

    def __call__(self, texts: Sequence[str], names: Sequence[str] = INPUT_NAMES[:2]) -> dict[str, np.ndarray]:
        """Tokenize and pad one batch: the model inputs named ``names``."""
        return pad_batch(self.encode(texts), names, pad_id=self.pad_id)


def _check_names(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in INPUT_NAMES]
    if unknown:
        raise UserError(f"cannot make model input(s) {', '.join(unknown)} from text",
                        fix="text encoders take " + ", ".join(INPUT_NAMES))


def pad_batch(
    encodings: Sequence[TokenizedText | tuple], names: Sequence[str] = INPUT_NAMES[:2], *, pad_id: int = 0,
    pad_to: int | None = None,
) -> dict[str, np.ndarray]:
    """int64 arrays [batch, longest] (or ``pad_to``) for ``names``: ids padded with ``pad_id``, attention_mask 1/0,
    token_type_ids padded with 0. Padding is on the right, where the encoders expect it."""
    _check_names(names)
    if not encodings:
        raise UserError("no texts to pad into a batch", fix="give at least one text")
    lengths = np.array([len(e[0]) for e in encodings])
    width = int(lengths.max()) if pad_to is None else int(pad_to)
    if width < lengths.max():
        raise UserError(f"pad_to={pad_to} is shorter than the longest text ({lengths.max()} tokens)",
                        fix="tokenize with max_length ≤ pad_to")
    ids = np.full((len(encodings), width), pad_id, np.int64)
    types = np.zeros((len(encodings), width), np.int64)
    for row, enc in enumerate(encodings):
        ids[row, : len(enc[0])] = enc[0]
        types[row, : len(enc[1])] = enc[1]
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
    arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    return {n: arrays[n] for n in names}


# --------------------------------------------------------------------------------------------- lengths and batching


def token_length_stats(lengths: Sequence[int] | np.ndarray, truncated: Sequence[bool] | np.ndarray | None = None) -> dict:
    """p50 / p95 / max / mean token count and how many texts were truncated: what ``max_seq_length`` costs."""
    arr = np.asarray(lengths, dtype=np.float64)
    if arr.size == 0:
        raise UserError("no token lengths to summarise", fix="give at least one text")
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p95": float(np.percentile(arr, 95)),
        "max": int(arr.max()),
        "truncated": int(np.count_nonzero(truncated)) if truncated is not None else 0,
    }


def first_come_batches(count: int, batch_size: int) -> list[np.ndarray]:
    """Batches in arrival order: what a server without length bucketing does."""
    _check_batch_size(batch_size)
    return [np.arange(i, min(i + batch_size, count)) for i in range(0, count, batch_size)]


def length_sorted_batches(lengths: Sequence[int] | np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Indices grouped so each batch holds texts of similar length (stable sort), so little padding is needed.
    Results come back in this order: scatter them back with the indices."""
    _check_batch_size(batch_size)
    order = np.argsort(np.asarray(lengths), kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def padding_waste(batches: Sequence[np.ndarray], lengths: Sequence[int] | np.ndarray) -> float:
    """Padded tokens per real token when each batch is padded to its longest text (0 = no waste)."""
    arr = np.asarray(lengths)
    real = int(arr.sum())
    padded = sum(int(len(b) * arr[b].max() - arr[b].sum()) for b in batches if len(b))
    return padded / real if real else 0.0


def batching_waste(lengths: Sequence[int] | np.ndarray, batch_size: int) -> dict:
    """Padding waste of first-come against length-sorted batching at one batch size."""
    return {
        "batch_size": batch_size,
        "first_come": padding_waste(first_come_batches(len(lengths), batch_size), lengths),
        "sorted": padding_waste(length_sorted_batches(lengths, batch_size), lengths),
    }


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise UserError(f"batch size {batch_size} must be at least 1", fix="use a positive batch size")


# --------------------------------------------------------------------------------------------- quality


def _average_ranks(a: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank (scipy.stats.rankdata's default)."""
    order = np.argsort(a, kind="mergesort")
    sorted_a = a[order]
    starts = np.r_[True, sorted_a[1:] != sorted_a[:-1]]
    group = np.cumsum(starts) - 1  # group index of each sorted element
    bounds = np.r_[np.flatnonzero(starts), len(a)]
    avg = (bounds[:-1] + bounds[1:] - 1) / 2 + 1  # mean of positions start..end-1, 1-based
    ranks = np.empty(len(a), dtype=np.float64)
    ranks[order] = avg[group]
    return ranks


def spearman(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Spearman rank correlation (Pearson on average ranks); NaN when either side is constant, as scipy gives."""
    a, b = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"spearman needs two sequences of one length, got {a.size} and {b.size}")
    if a.size < 2:
        return float("nan")
    ra, rb = _average_ranks(a), _average_ranks(b)
    ra -= ra.mean()
    rb -= rb.mean()
    denom = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def exact_length_texts(tok: TextTokenizer, words: Sequence[str], count: int, tokens: int) -> list[str]:
    """``count`` texts of exactly ``tokens`` tokens (special tokens included) under ``tok``, made of ``words`` (each
    text starts at another word; a word that would overshoot is skipped): a workload of one known length, so two
    tokenizers or two engines are compared on the same work."""
    if not words:
        raise UserError("no words to make texts of", fix="give the words of a few sentences")
    rows = []
    for row in range(count):
        cur: list[str] = []
        i = (row * 997) % len(words)
        for _ in range(20000):
            cand = [*cur, words[i % len(words)]]
            i += 1
            n = tok.encode([" ".join(cand)])[0].full_length
            if n <= tokens:
                cur = cand
            if n == tokens:
                break
        else:
            raise UserError(f"could not make a text of exactly {tokens} tokens from these words",
                            fix="give more varied words, or a length the tokenizer can reach with them")
        rows.append(" ".join(cur))
    return rows


def decode_texts(tokenizer_json: str | Path, inputs: dict[str, np.ndarray]) -> list[str] | None:
    """Texts back from their token ids (``input_ids``, ``attention_mask`` of a tokenized dataset's inputs), decoded by
    ``tokenizer_json`` with special tokens and padding dropped: what a client that sends strings would have sent (an
    uncased tokenizer's texts come back lower-cased; they tokenize to the same ids). None without token ids."""
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if ids is None:
        return None
    from tokenizers import Tokenizer

    mask = mask if mask is not None else np.ones_like(ids)
    rows = [[int(t) for t, m in zip(row, keep, strict=True) if m] for row, keep in zip(ids, mask, strict=True)]
    return Tokenizer.from_file(str(tokenizer_json)).decode_batch(rows, skip_special_tokens=True)
