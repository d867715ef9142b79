"""A new runtime or pass is one class that registers itself; unknown names get the list of known ones."""

import numpy as np
import pytest

from servopt.errors import UserError
from servopt.passes import PASSES, get_pass
from servopt.runtimes import RUNTIMES, Runtime, Session, open_session, register_runtime


def test_a_new_runtime_is_one_registered_class():
    class EchoSession(Session):
        def __init__(self) -> None:
            self.input_names = ["x"]

        def run_prepared(self, prepared):
            return prepared["x"] * 2

        def info(self) -> dict:
            return {"runtime": "echo"}

    @register_runtime
    class Echo(Runtime):
        name = "echo-test"
        artifact_formats = ("onnx",)

        def open(self, artifact: dict, options: dict) -> Session:
            return EchoSession()

    try:
        out = open_session({"format": "onnx", "path": "unused"}, "echo-test").run({"x": np.ones(3)})
        assert out.tolist() == [2.0, 2.0, 2.0]
    finally:
        RUNTIMES.classes.pop("echo-test")


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UserError, match="unknown pass 'nope'") as e:
        get_pass("nope")
    assert "ort-quantize-static" in e.value.fix and len(PASSES.classes) >= 10
