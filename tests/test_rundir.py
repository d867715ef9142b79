"""The run directory's one way of reusing a stored re-measure (``rundir.stored``)."""

from __future__ import annotations

import json

from servopt.contracts import Interleaved
from servopt.optimize.rundir import stored


def test_a_stored_re_measure_is_reused_only_for_what_it_measured(tmp_path):
    path = tmp_path / "interleave.json"
    parse = Interleaved.model_validate
    assert stored(path, parse, {"k"}) is None, "nothing stored"
    path.write_text(Interleaved(reference="r", rounds=3, order=[], variants={}, cache_key="k").model_dump_json())
    assert stored(path, parse, {"k", "k2"}).rounds == 3
    assert stored(path, parse, {"other"}) is None, "another measurement: measured again"
    path.write_text(path.read_text()[:20])
    assert stored(path, parse, {"k"}) is None, "a torn file is measured again, never trusted"
    path.write_text(json.dumps({"cache_key": "k", "rounds": "many"}))
    assert stored(path, parse, {"k"}) is None, "a file this servopt cannot read is measured again"
