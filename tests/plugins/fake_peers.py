"""Peers written as a plugin would be (``SERVOPT_PLUGINS=fake_peers``), for ``tests/test_peers.py``: one that builds a
copy of the run's fp32 ONNX model (the pick of the tiny run), one that is never available here, one that finds out
only when it builds."""

from __future__ import annotations

import shutil

from servopt.contracts import Artifact
from servopt.peers.base import Peer, PeerAnswer, PeerInputs, PeerUnavailable, register_peer


@register_peer
class CopyPeer(Peer):
    name = "copy-of-fp32"
    description = "the run's fp32 ONNX file, copied"

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        assert inputs.onnx is not None
        path = inputs.out_dir / "model.onnx"
        shutil.copyfile(inputs.onnx, path)
        return PeerAnswer(artifact=Artifact(format="onnx", path=str(path)), configuration={"tool": "shutil.copyfile"})


@register_peer
class NeverHere(Peer):
    name = "never-here"
    description = "a tool this machine cannot run"

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        return False, "it needs a frobnicator, which this machine has not"


@register_peer
class GoneAtBuild(Peer):
    name = "gone-at-build"
    description = "a tool that finds out in its build that it cannot run"

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        raise PeerUnavailable("its model hub cannot be reached from here")
