"""The lean serving path answers exactly as the general one: batches filled in place against np.pad, and small
requests prepared on the event loop while larger ones still go to a worker thread."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from conftest import LiveServer
from servopt.families.text import TextEmbedding
from servopt.settings import ServeSettings
from test_text_serving import tiny_text_encoder

KEY = "lean-key"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    encoder = tiny_text_encoder(tmp_path_factory.mktemp("lean"))
    with LiveServer(encoder, ServeSettings(max_delay_us=0, max_body_mb=0.01, api_key=KEY), name="tiny") as s:
        yield s


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_collate_fills_a_batch_as_padding_each_request_would():
    rng = np.random.default_rng(2)
    feeds = []
    for rows, width in ((1, 7), (3, 12), (2, 3)):
        feeds.append({"input_ids": rng.integers(1, 100, (rows, width)), "attention_mask": np.ones((rows, width), np.int64),
                      "token_type_ids": rng.integers(0, 2, (rows, width))})
    got = TextEmbedding().collate(feeds)
    for name in feeds[0]:
        want = np.concatenate([np.pad(f[name], ((0, 0), (0, 12 - f[name].shape[1]))) for f in feeds])
        assert got[name].dtype == want.dtype and np.array_equal(got[name], want), name


def test_small_requests_are_prepared_on_the_event_loop_larger_ones_in_a_worker(tiny, monkeypatch):
    """One short text (or a few token ids) is tokenized on the event loop: cheaper than the hand-off to a worker thread.
    Several texts, or a long one, still go to a worker, so the loop is never held long."""
    threads: list[str] = []
    original = TextEmbedding.model_inputs

    def spy(self, spec, inputs, params):
        threads.append(threading.current_thread().name)
        return original(self, spec, inputs, params)

    monkeypatch.setattr(TextEmbedding, "model_inputs", spy)
    loop_thread = tiny.thread.name
    for value, where in (("the cat sat", "loop"), (["the cat"] * 5, "worker"), ("the " * 200, "worker"), ([2, 5, 3], "loop")):
        r = httpx.post(f"{tiny.url}/v1/embeddings", headers=AUTH, json={"model": "tiny", "input": value})
        assert r.status_code == 200, r.text
        assert (threads[-1] == loop_thread) == (where == "loop"), (value, threads[-1], loop_thread)
