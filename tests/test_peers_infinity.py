"""The Infinity peer's server start, up to what needs its 1.6 GB environment: ``Infinity.serve`` runs the environment's
``infinity_emb`` through ``serve.harness.AppProcess`` (the library's one server start), here a stand-in executable
that speaks the same route. The real server is run by ``servopt compare --peers infinity`` (docs/peers.md)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from servopt.bench import launcher
from servopt.contracts import Artifact
from servopt.peers.base import PEERS, PeerAnswer, PeerInputs
from servopt.spec import ModelSpec

# A stand-in for infinity_emb v2: writes how it was started, answers POST /v1/embeddings only, or exits at once.
FAKE = """#!{python}
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
json.dump({{"args": args, "cwd": os.getcwd(), "hf_home": os.environ.get("HF_HOME"),
            "offline": os.environ.get("HF_HUB_OFFLINE"), "pythonpath": os.environ.get("PYTHONPATH")}},
          open(os.environ["FAKE_RECORD"], "w"))
if os.environ.get("FAKE_EXIT"):
    print("cannot load the model", flush=True)
    sys.exit(3)
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = self.path == "/v1/embeddings" and body["model"] == args[args.index("--served-model-name") + 1]
        out = json.dumps({{"data": [{{"embedding": [0.0]}} for _ in body["input"]]}}).encode()
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), H).serve_forever()
"""


@pytest.fixture
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "infinity_emb"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.setenv("PYTHONPATH", "/somewhere/servopt/src")
    return bin_dir / "python", record


def _inputs_and_answer(tmp_path: Path) -> tuple[PeerInputs, PeerAnswer]:
    folder = tmp_path / "out" / "model"
    folder.mkdir(parents=True)
    (folder / "model_quantized.onnx").write_bytes(b"")
    inputs = PeerInputs(peer="infinity", run_dir=str(tmp_path), family="text-embedding", spec=ModelSpec(inputs=[], outputs=[]),
                        original=Artifact(format="torch"), evaluation=str(tmp_path / "eval.npz"), out=str(tmp_path / "out"))
    answer = PeerAnswer(artifact=Artifact(format="onnx", path=str(folder / "model_quantized.onnx")), offline=False)
    return inputs, answer


def test_infinity_serves_from_its_folder_offline_and_stops(tmp_path, fake_env):
    python, record = fake_env
    inputs, answer = _inputs_and_answer(tmp_path)
    server = PEERS.get("infinity").serve(inputs, answer, python)
    try:
        started = json.loads(record.read_text())
        assert Path(started["cwd"]) == tmp_path / "out" / "model"  # --model-id . in the folder (Optimum refuses abs paths)
        assert {"--pooling-method", "mean", "--model-id", "."} <= set(started["args"])
        assert started["offline"] == "1" and started["hf_home"] == str(tmp_path / "out" / "hf-home")
        assert started["pythonpath"] is None  # servopt's source must not shadow its environment's packages
        r = httpx.post(f"{server.url}/v1/embeddings", json={"model": server.model, "input": ["a", "b"]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        assert server.api == "openai-embeddings" and server.start_s is not None and server.start_s > 0
        assert any(p.pid == server.pid for p in launcher._running), "a stopped sweep must stop it too"
    finally:
        server.stop()
    assert server.pid is not None
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(server.pid, 0)
    assert all(p.pid != server.pid for p in launcher._running)


def test_an_infinity_that_exits_while_starting_says_so_with_its_output(tmp_path, fake_env, monkeypatch):
    python, _ = fake_env
    monkeypatch.setenv("FAKE_EXIT", "1")
    inputs, answer = _inputs_and_answer(tmp_path)
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 while starting.*cannot load the model"):
        PEERS.get("infinity").serve(inputs, answer, python)
