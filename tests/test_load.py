"""The one load generator (``servopt.serve.load``): its schedules, senders and tally against small asyncio servers whose
answers are known, latency from the schedule (no coordinated omission), the client's lag and validity, and LoadGen's
early-stopping rule."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path

import numpy as np
import pytest

from servopt.errors import UserError
from servopt.serve.load import Closed, Kind, Open, Pool, claim, open_sender, queries_for, run
from servopt.serve.load.earlystop import binomial_cdf, min_passing, most_over
from servopt.serve.load.requests import Request, synthetic_sample, tensor_request, text_requests
from servopt.serve.load.senders.base import Answer, Sender, http_answer
from servopt.serve.load.senders.raw import request_bytes


async def _http_server(answer, connections: list[int] | None = None):
    """A keep-alive HTTP/1.1 server answering each request's body with ``await answer(body)`` → raw answer bytes (and
    closing after an answer that asks to), counting its connections in ``connections``."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if connections is not None:
            connections[0] += 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            body = await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
            out = await answer(body)
            writer.write(out)
            await writer.drain()
            if b"Connection: close" in out:
                writer.close()
                break

    return await asyncio.start_server(handle, "127.0.0.1", 0)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def _serve_and_load(answer, schedule, seconds, **kw):
    async def main():
        server = await _http_server(answer)
        port = server.sockets[0].getsockname()[1]
        async with server, open_sender(kw.pop("sender", "raw"), f"http://127.0.0.1:{port}") as sender:
            return await run(sender, Pool([Request("/x", b"{}")]), schedule, seconds, **kw)

    return asyncio.run(main())


def test_the_raw_sender_reads_lengths_chunks_refusals_drops_and_reconnects_after_close():
    """Every answer shape the servers it measures give, on keep-alive connections: a wrong length read (a binary
    tensor answer's Inference-Header-Content-Length taken for its Content-Length) would corrupt the next answer."""
    seen: list[bytes] = []

    async def answer(body: bytes):
        seen.append(body)
        kind = body.decode()
        return {"plain": OK,
                "binary": b"HTTP/1.1 200 OK\r\nInference-Header-Content-Length: 2\r\nContent-Length: 5\r\n\r\n{}abc",
                "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n3;x=y\r\n!!!\r\n0\r\n\r\n",
                "busy": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 8\r\n\r\noverload",
                "dropped": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 21\r\n\r\ndropped after waiting",
                "close": b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"}[kind]

    connections = [0]

    async def main():
        server = await _http_server(answer, connections)
        port = server.sockets[0].getsockname()[1]
        async with server, open_sender("raw", f"http://127.0.0.1:{port}", api_key="k") as sender:
            pool = Pool([Request("/x", k.encode()) for k in ("plain", "binary", "chunked", "busy", "dropped", "close")])
            return await run(sender, pool, Closed(2), 0.3)

    summary, _ = asyncio.run(main())
    assert summary.ok > 0 and summary.refused > 0 and summary.dropped > 0 and summary.failed == 0
    assert summary.errors.keys() == {"503", "503 dropped"} and summary.sent == summary.ok + summary.refused + summary.dropped
    assert set(seen) == {b"plain", b"binary", b"chunked", b"busy", b"dropped", b"close"}
    assert connections[0] > 2, "answers asking to close made the client open another connection"
    wire = request_bytes("127.0.0.1:9", Request("/v1/embeddings", b"{}"), api_key="k")
    assert wire.startswith(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:9\r\n") and b"Authorization: Bearer k\r\n" in wire
    assert wire.endswith(b"Content-Length: 2\r\n\r\n{}")


def test_every_sender_sorts_answers_in_the_same_words():
    assert http_answer(200, b"") == Answer(Kind.ACCEPTED, "200")
    assert http_answer(503, b"overloaded").kind is Kind.REFUSED and http_answer(429, b"").kind is Kind.REFUSED
    assert http_answer(503, b"... dropped after waiting 900 ms ...").kind is Kind.DROPPED
    assert http_answer(400, b"").kind is Kind.ERROR and http_answer(400, b"").status == "http 400"


@pytest.mark.parametrize("sender", ["raw", "aiohttp"])
def test_an_open_loop_keeps_its_rate_whatever_the_answers_and_counts_what_its_cap_did_not_send(sender):
    """At 200/s for 0.5 s against a server answering in 50 ms, about 100 arrive with several in flight at once; with a
    cap of 2 in flight the rest are counted as not sent (and the step is not valid), never queued in the client."""
    async def slow(_body: bytes):
        await asyncio.sleep(0.05)
        return OK

    # the test's server shares the client's event loop: a lag margin for this machine, not the client's own test
    free, _ = _serve_and_load(slow, Open(200, seed=1), 0.5, sender=sender, margin_ms=100.0)
    assert 50 <= free.ok <= 170 and free.failed == 0 and free.client.unsent == 0 and free.valid, free
    assert free.latency_ms.p50 >= 50 and free.sender == sender and free.rate_rps == 200
    capped, _ = _serve_and_load(slow, Open(200, seed=1), 0.5, max_in_flight=2, sender=sender, margin_ms=100.0)
    assert capped.client.unsent > 10 and capped.ok + capped.client.unsent >= 50
    assert not capped.valid and "not sent" in capped.invalid


def test_latency_runs_from_the_schedule_so_a_client_that_falls_behind_cannot_hide_the_queue():
    """A client whose loop is blocked for 0.2 s (a stall of its own) sends the arrivals due meanwhile late, all at
    once: timed from the send they would look fast; timed from their schedule they carry the wait. Past its margin
    the step is not valid: it measured the client."""
    async def fast(_body: bytes):
        return OK

    class Stalling(Sender):
        name = "stalling"

        def __init__(self, inner: Sender) -> None:
            super().__init__(inner.url)
            self.inner, self.count = inner, 0

        async def send(self, request: Request) -> Answer:
            self.count += 1
            if self.count == 20:
                time.sleep(0.2)  # the client's own event loop, blocked
            return await self.inner.send(request)

    async def main():
        server = await _http_server(fast)
        port = server.sockets[0].getsockname()[1]
        async with server, open_sender("raw", f"http://127.0.0.1:{port}") as inner:
            return await run(Stalling(inner), Pool([Request("/x", b"{}")]), Open(200, seed=3), 0.6, margin_ms=5.0)

    summary, tally = asyncio.run(main())
    sent_latency = np.percentile((np.asarray(tally.done) - np.asarray(tally.sent)) * 1000, 99)
    assert summary.latency_ms.p99 >= 100 > sent_latency, "timed from the schedule, the stall shows"
    assert summary.client.lag_ms.p99 >= 100 and summary.client.behind_share > 0.05
    assert not summary.valid and "behind their schedule" in summary.invalid


def test_a_run_stops_at_once_when_asked_and_counts_what_was_in_flight():
    async def slow(_body: bytes):
        await asyncio.sleep(0.5)
        return OK

    t0 = time.perf_counter()
    flag = {"at": t0 + 0.2}
    summary, _ = _serve_and_load(slow, Open(100, seed=1), 10.0, stop=lambda: time.perf_counter() > flag["at"])
    assert time.perf_counter() - t0 < 2.0, "a 10 s step ended when stop() said so"
    assert summary.failed == summary.sent and summary.errors == {"no answer": summary.sent} and summary.sent > 5


def test_a_closed_loop_keeps_its_clients_busy_and_counts_its_cpu():
    async def fast(_body: bytes):
        await asyncio.sleep(0.01)
        return OK

    summary, _ = _serve_and_load(fast, Closed(4), 0.4, probe=lambda: (time.perf_counter(),), margin_ms=100.0)
    assert summary.mode == "closed" and summary.concurrency == 4 and summary.valid
    assert 60 <= summary.ok <= 170 and summary.client.lag_ms.p99 == 0.0
    assert summary.client.cpu_ms_per_request is not None and summary.client.cpu_ms_per_request > 0
    assert summary.probe and summary.probe[0] == pytest.approx(summary.duration_s, abs=0.1)
    limited, _ = _serve_and_load(fast, Closed(4), 5.0, max_requests=12)
    assert limited.sent == 12


def test_requests_are_encoded_once_for_http_and_grpc():
    meta = {"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3, -1]},
                                    {"name": "text", "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]}
    r = tensor_request(meta, synthetic_sample(meta), grpc=True)
    assert r.path == "/v2/models/m/infer" and r.content_type == "application/octet-stream"
    n = int(dict(r.headers)["Inference-Header-Content-Length"])
    head = json.loads(r.body[:n])
    (x, text), raw = head["inputs"], r.body[n:]
    assert x["shape"] == [1, 3, 16] and x["parameters"]["binary_data_size"] == 1 * 3 * 16 * 4
    assert text["shape"] == [1] and len(raw) == x["parameters"]["binary_data_size"] + text["parameters"]["binary_data_size"]
    assert head["outputs"] == [{"name": "y", "parameters": {"binary_data": True}}]
    assert r.grpc.model_name == "m" and list(r.grpc.raw_input_contents) == [raw[:192], raw[192:]]
    (t,) = text_requests(meta, ["héllo"])
    assert json.loads(t.body) == {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["héllo"]}]}


def test_a_pool_draws_every_request_in_proportion_and_repeats_with_its_seed():
    reqs = [Request(f"/{i}", b"") for i in range(4)]
    draws = [Pool(reqs, seed=5).next().path for _ in range(1)]
    pool = Pool(reqs, seed=5)
    seq = [pool.next().path for _ in range(400)]
    assert {p: seq.count(p) for p in set(seq)}.keys() == {"/0", "/1", "/2", "/3"} and min(seq.count(f"/{i}") for i in range(4)) > 60
    assert draws[0] == seq[0] and [Pool(reqs, seed=5).next().path for _ in range(1)] == draws


def test_the_early_stopping_counts_are_loadgens():
    """LoadGen's rule: with no answer over the bound a p99 claim at 99 % needs 459 queries (ceil(log 0.01 / log 0.99)),
    each answer over it needs 150-200 more; the binomial tail matches SciPy's."""
    from scipy.stats import binom

    assert queries_for(0, 0.99) == 459 and queries_for(0, 0.99, 0.95) == 299 and queries_for(0, 0.5) == 7
    counts = [queries_for(t, 0.99) for t in range(6)]
    assert counts == sorted(counts) and all(140 < b - a < 210 for a, b in itertools.pairwise(counts))
    for t, n, q in ((0, 459, 0.01), (5, 1307, 0.01), (40, 3000, 0.01), (3, 50, 0.2)):
        assert binomial_cdf(t, n, q) == pytest.approx(binom.cdf(t, n, q), rel=1e-9)
    h = min_passing(5, 0.99)
    assert binom.cdf(5, h + 5, 0.01) <= 0.01 < binom.cdf(5, h + 4, 0.01), "the least passing count"
    assert most_over(458, 0.99) is None and most_over(459, 0.99) == 0 and queries_for(most_over(3000, 0.99), 0.99) <= 3000


def test_a_claim_refuses_too_few_queries_whatever_their_percentile():
    fast = [1.0] * 200
    small = claim(fast, 0, 50.0, 0.99)
    assert not small.holds and small.too_few and small.needed == 459 and small.estimate_ms is None
    many = claim([1.0] * 998 + [80.0] * 2, 0, 50.0, 0.99)  # 1,000 queries carry 2 over the bound (838 needed), not 3
    assert many.holds and many.over == 2 and many.allowed == 2 and many.estimate_ms == 1.0
    over = claim([1.0] * 997 + [80.0] * 3, 0, 50.0, 0.99)
    assert not over.holds and over.needed == 1001 and over.estimate_ms == 80.0, "the estimate and the claim agree"
    refused = claim([1.0] * 997, 3, 50.0, 0.99)
    assert refused.over == 3 and not refused.holds and refused.estimate_ms == float("inf"), "unanswered: over the bound"


def test_the_user_s_evaluation_data_is_sent_as_the_server_receives_it(tmp_path, color_folder):
    """Capacity under the user's requests (issue 42): an image folder's evaluation images go as their tensors (one
    sample a request, the server's binary tensors) or, where the target says its clients send images, as their files
    to /classify; a text encoder's evaluation texts (token ids decoded, the server tokenizes) one a request. The files
    of an image folder travel with the saved evaluation data, outside what its key hashes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from servopt.contracts import ServedData
    from servopt.data.dataset import Dataset, load_image_folder
    from servopt.data.preprocess import Preprocess
    from servopt.passes.base import dataset_digest
    from servopt.serve.load.requests import served_requests

    images = load_image_folder(color_folder, preprocess=Preprocess(resize=16, crop=16), input_name="input")
    images.save(tmp_path / "eval.npz")
    saved = Dataset.load(tmp_path / "eval.npz")
    assert saved.files == images.files and len(saved.files) == len(saved) and all(f.endswith(".png") for f in saved.files)
    assert dataset_digest(images) == dataset_digest(Dataset(images.inputs, images.labels)), "files are not in the key"
    assert saved.subset(np.array([1, 0])).files == [saved.files[1], saved.files[0]]
    meta = {"name": "m", "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 16, 16]}],
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 3]}]}
    tensors, what = served_requests(meta, ServedData(eval_data=str(tmp_path / "eval.npz")))
    assert len(tensors) == len(images) and "binary tensors" in what
    head = json.loads(tensors[0].body[:int(dict(tensors[0].headers)["Inference-Header-Content-Length"])])
    assert head["inputs"][0]["shape"] == [1, 3, 16, 16] and tensors[0].path == "/v2/models/m/infer"
    files, what = served_requests(meta, ServedData(eval_data=str(tmp_path / "eval.npz"), images=saved.files))
    assert files[0].path == "/v2/models/m/classify" and files[0].content_type == "image/png" and "/classify" in what
    assert files[0].body == Path(saved.files[0]).read_bytes()

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "long", "story"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.add_special_tokens(words[:4])
    tok.save(str(tmp_path / "tokenizer.json"))
    ids = np.array([[2, 4, 5, 6, 3, 0], [2, 7, 8, 7, 8, 3]])
    Dataset({"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64)}, lengths=np.array([5, 6])).save(tmp_path / "t.npz")
    text_meta = {"name": "enc", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
                 "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 4]}]}
    texts, what = served_requests(text_meta, ServedData(eval_data=str(tmp_path / "t.npz"), tokenizer=str(tmp_path / "tokenizer.json")))
    assert [json.loads(r.body)["inputs"][0]["data"] for r in texts] == [["the cat sat"], ["long story long story"]]
    assert "2 evaluation texts" in what
    with pytest.raises(UserError, match="no token ids to decode"):
        served_requests(text_meta, ServedData(eval_data=str(tmp_path / "t.npz")))


def test_the_sweep_hands_the_probe_the_user_s_data_as_its_target_s_clients_send_it(tmp_path):
    """``Sweep.capacity_probe`` gets a typed ``ServedData``: the run's eval.npz, a text encoder's tokenizer, and the
    image files only for a target whose clients send images."""
    from types import SimpleNamespace

    from servopt.optimize.instance import SweepInstance
    from servopt.optimize.targets import PRESETS

    sweep = SimpleNamespace(model=SimpleNamespace(spec=SimpleNamespace(preprocessing={"tokenizer": "/m/tokenizer.json"})),
                            eval_data=SimpleNamespace(files=["/d/a.png", "/d/b.png"]),
                            dir=SimpleNamespace(eval_data=tmp_path / "eval.npz"))
    tensors = SweepInstance.served_data(sweep, PRESETS["cpu-server"])
    assert tensors.eval_data == str(tmp_path / "eval.npz") and tensors.tokenizer == "/m/tokenizer.json" and tensors.images == []
    images = SweepInstance.served_data(sweep, PRESETS["cpu-server"].model_copy(update={"requests": "images"}))
    assert images.images == ["/d/a.png", "/d/b.png"]
