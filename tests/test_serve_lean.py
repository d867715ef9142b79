"""The lean serving path answers exactly as the general one: batches filled in place against np.pad."""

from __future__ import annotations

import numpy as np

from servopt.families.text import TextEmbedding


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
