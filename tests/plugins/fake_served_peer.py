"""A peer with a server of its own, written as a plugin would be (``SERVOPT_PLUGINS=fake_served_peer``), for
``tests/test_peers.py``: its answer is a copy of the run's fp32 ONNX file, measured only served, under
``servopt serve FILE`` (standing in for a tool's own server: Infinity, say) on the OIP v2 API."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from servopt.contracts import Artifact
from servopt.peers.base import Peer, PeerAnswer, PeerInputs, Server, register_peer


@register_peer
class ServedCopy(Peer):
    name = "served-copy"
    description = "the run's fp32 ONNX file behind a server of its own"
    serves = "oip-v2"

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        assert inputs.onnx is not None
        path = inputs.out_dir / "model.onnx"
        shutil.copyfile(inputs.onnx, path)
        return PeerAnswer(artifact=Artifact(format="onnx", path=str(path)), offline=False,
                          configuration={"tool": "servopt serve, standing in", "isa": inputs.isa})

    def serve(self, inputs: PeerInputs, answer: PeerAnswer, python: Path) -> Server:
        from servopt.serve.harness import ServerProcess

        assert answer.artifact.path is not None
        t0 = time.perf_counter()
        proc = ServerProcess(answer.artifact.path, "--name", "copy")
        return Server(url=proc.url, model="copy", stop=proc.stop, api=self.serves, pid=proc.proc.pid, command=proc.command,
                      start_s=time.perf_counter() - t0)


@register_peer
class NeverServes(Peer):
    name = "server-never-up"
    description = "a tool whose server dies at start"
    serves = "oip-v2"

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        assert inputs.onnx is not None
        return PeerAnswer(artifact=Artifact(format="onnx", path=inputs.onnx), offline=False)

    def serve(self, inputs: PeerInputs, answer: PeerAnswer, python: Path) -> Server:
        raise RuntimeError("port 1 is not ours: exited with 1")
