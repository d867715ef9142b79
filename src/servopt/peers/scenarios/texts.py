"""Texts in, embeddings out: each contender's whole text path timed end to end, as its users call it.

A user asking "is servopt faster than sentence-transformers?" means texts in and embeddings out on both sides. The
``single`` and ``offline`` scenarios time each answer's model on the run's token ids, tokenized once; these time the
Python around it too. servopt's pick runs through servopt's own text path (``families.text.text_encoder``: the
server's tokenizer, length-sorted batches each padded to its own longest, the session; pooling and normalization are
in its graph); a peer with a text path of its own (``Peer.encodes``: sentence-transformers' ``encode()``, its
tokenizer, its sort by length, its pooling in torch) runs through it, in its own environment (``Peer.encoder``).
Peers without one have no texts figure.

The workload is the run's evaluation texts (its token ids decoded by the model's tokenizer, special tokens and
padding dropped), the same list for everyone, each contender in a fresh process per round (``TextsJob``; the runner
flips the order):

- ``texts``: all of them in one call, in batches of the run's batch size, each side batching its own way: texts/s;
- ``texts-single``: one text per call, round-robin over the first 32: the median latency.

Both phases use the protocol's stopping rule and interference watch (``bench.protocol``). The embeddings of all the
texts are saved once per measurement, so the comparison judges them against the original's outputs like every other
answer (``texts_quality`` in what ran).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from servopt.bench.jobs import JobBase, OpenSpec, register_job
from servopt.bench.protocol import Protocol
from servopt.contracts import Contract, Interference, Latency
from servopt.peers.base import Encode, PeerAnswer, PeerInputs
from servopt.peers.scenario import Scenario, register_scenario
from servopt.spec import ModelSpec

FAMILIES = ("text-embedding",)  # the families whose answers take texts in
SINGLE_TEXTS = 32  # texts-single cycles over this many of the evaluation texts (as the single scenario's samples)


class TextsMeasured(Contract):
    """One contender's text path in one round: its single-text latency, its texts/s over all the texts, the machine's
    other load meanwhile, and where its embeddings of the texts were saved."""

    status: Literal["ok", "failed"] = "ok"
    error: str | None = None
    through: str = ""  # what turned the texts into embeddings
    load_s: float | None = None
    texts: int = 0
    single_ms: Latency | None = None
    texts_per_s: float | None = None
    offline_calls: int = 0
    interference: Interference | None = None
    embeddings: str | None = None  # .npy [texts, dimensions]

    @property
    def single_p50_ms(self) -> float | None:
        return self.single_ms.p50 if self.single_ms is not None else None


class Texts(Scenario):
    """A figure of a ``TextsMeasured``: its attribute ``field`` (None on any other measurement)."""

    texts: ClassVar[bool] = True
    field: ClassVar[str]

    def figure(self, m: Any) -> float | None:
        return getattr(m, self.field, None) if isinstance(m, TextsMeasured) else None


# (name, metric, better, TextsMeasured's attribute, what it is, its column heading)
FIGURES = (("texts", "texts_per_s", "higher", "texts_per_s",
            "the run's evaluation texts in, embeddings out, in batches of the run's batch size: texts/s",
            "texts in: texts/s (batches)"),
           ("texts-single", "texts_p50_ms", "lower", "single_p50_ms",
            "one evaluation text in, its embedding out, one call at a time: the median latency", "texts in: p50 (one text a call)"))
TEXTS = [f[0] for f in FIGURES]
for _name, _metric, _better, _field, _what, _label in FIGURES:
    register_scenario(type(f"Texts_{_metric}", (Texts,), {"name": _name, "metric": _metric, "better": _better, "field": _field,
                                                          "description": _what, "label": _label}))


@register_job
class TextsJob(JobBase):
    """One contender's text path timed in a fresh process: servopt's (``session`` + ``spec``) or a peer's own
    (``peer`` + ``answer``, run in the peer's environment)."""

    kind: Literal["peer-texts"] = "peer-texts"
    result_type: ClassVar[type[Contract]] = TextsMeasured
    timeout_s: ClassVar[float] = 1800.0
    texts: str  # a JSON file: the list of texts
    batch_size: int
    protocol: Protocol
    save_embeddings: str
    session: OpenSpec | None = None
    spec: ModelSpec | None = None
    peer: PeerInputs | None = None
    answer: PeerAnswer | None = None

    def encoder(self) -> tuple[Encode, str]:
        if self.peer is not None and self.answer is not None:
            from servopt.peers.base import PEERS

            peer = PEERS.get(self.peer.peer)
            return peer.encoder(self.peer, self.answer), f"its own text path ({peer.description})"
        if self.session is None or self.spec is None:
            raise ValueError("a texts job needs servopt's session and spec, or a peer and its answer")
        from servopt.families.text import text_encoder

        return (text_encoder(self.spec, self.session.open()),
                "servopt's text path (its tokenizer, length-sorted batches, the session; pooling in the graph)")

    def run(self, started: float) -> TextsMeasured:
        return measure_texts(self)

    def runtimes(self) -> list[str]:
        return [self.session.runtime] if self.session is not None else []


def offline_calls(proto: Protocol, texts: int, batch_size: int) -> int:
    """Calls of all the texts that give the protocol's batch phase its minimum of batches (at least 2)."""
    return max(2, math.ceil(proto.batch_min_runs * batch_size / max(1, texts)))


def measure_texts(job: TextsJob) -> TextsMeasured:
    """Load the text path, embed every text once (its warm-up; saved for the quality check), then the two phases."""
    import numpy as np

    from servopt.bench.protocol import _phase as timed_phase  # the protocol's one timed phase (stopping rule, CPU watch)

    texts: list[str] = json.loads(Path(job.texts).read_text(encoding="utf-8"))
    if not texts:
        return TextsMeasured(status="failed", error="no texts to encode")
    t0 = time.perf_counter()
    encode, through = job.encoder()
    load_s = time.perf_counter() - t0
    emb = np.asarray(encode(texts, job.batch_size), dtype=np.float32)
    if emb.shape[0] != len(texts):
        return TextsMeasured(status="failed", error=f"{len(texts)} texts in, {emb.shape[0]} embeddings out", through=through)
    np.save(job.save_embeddings, emb)
    proto = job.protocol
    single = timed_phase("texts-single", lambda t: encode(t, 1), [[t] for t in texts[:SINGLE_TEXTS]], proto,
                         proto.min_runs, proto.min_seconds, proto.warmup, 1)
    calls = offline_calls(proto, len(texts), job.batch_size)
    offline = timed_phase("texts", lambda t: encode(t, job.batch_size), [texts], proto, calls, proto.batch_min_seconds, 0,
                          len(texts))
    return TextsMeasured(through=through, load_s=round(load_s, 3), texts=len(texts), single_ms=single.latency,
                         texts_per_s=offline.throughput, offline_calls=offline.latency.n or 0,
                         interference=Interference(single=single.interference, batch=offline.interference,
                                                   flagged=single.interference.flagged or offline.interference.flagged),
                         embeddings=job.save_embeddings)
