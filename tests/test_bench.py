"""The benchmark protocol: stopping rule, statistics, interference, accuracy counts, schema."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import channel_mean_onnx, write_color_folder
from servopt.bench.interference import CpuMonitor
from servopt.bench.stats import latency_summary, median_ci95, timed_loop
from servopt.cli import app
from servopt.families.image import classification_accuracy, format_accuracy
from servopt.families.metrics import agreement
from servopt.results import read_jsonl, validate_result, write_json_atomic

runner = CliRunner()


class FakeClock:
    """Each call of the timed function advances time by ``step_ns``."""

    def __init__(self, step_ns: int) -> None:
        self.now, self.step = 0, step_ns

    def __call__(self) -> int:
        return self.now

    def work(self, _x) -> None:
        self.now += self.step


def test_stopping_rule_needs_both_count_and_duration():
    clock = FakeClock(step_ns=1_000_000)  # 1 ms per call
    loop = timed_loop(clock.work, [0], min_runs=10, min_seconds=0.05, warmup=0, clock=clock)
    assert len(loop.times_ns) == 50 and loop.stopped_by == "rule"  # duration was the binding minimum
    clock = FakeClock(step_ns=100_000_000)  # 100 ms per call
    loop = timed_loop(clock.work, [0], min_runs=10, min_seconds=0.05, warmup=0, clock=clock)
    assert len(loop.times_ns) == 10  # count was the binding minimum


def test_stopping_rule_caps_at_max_seconds():
    clock = FakeClock(step_ns=1_000_000_000)
    loop = timed_loop(clock.work, [0], min_runs=1000, min_seconds=1, max_seconds=5, warmup=0, clock=clock)
    assert loop.stopped_by == "max_seconds" and len(loop.times_ns) == 5


def test_warmup_calls_are_not_timed():
    calls = []
    clock = FakeClock(step_ns=1)
    timed_loop(lambda x: (calls.append(x), clock.work(x)), [1, 2], min_runs=3, min_seconds=0, warmup=4, clock=clock)
    assert len(calls) == 7


def test_latency_summary_and_median_ci():
    times = [int(x * 1e6) for x in range(1, 101)]  # 1..100 ms
    s = latency_summary(times)
    assert s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01) and s["n"] == 100
    lo, hi = s["p50_ci95"]
    assert 40 <= lo < 50.5 < hi <= 61
    assert median_ci95(np.arange(3.0)) == (0.0, 2.0)


def test_accuracy_and_agreement_counts():
    logits = np.array([[3, 1, 0], [0, 2, 1], [0, 1, 2], [5, 0, 0.0]])
    acc = classification_accuracy(logits, np.array([0, 1, 1, 2]))
    assert (acc.correct, acc.total, acc.correct_top5, acc.ties) == (2, 4, 4, 0)
    assert format_accuracy(acc) == "50.00% (2/4 correct)"
    agr = agreement(logits + 0.5 * np.eye(3)[[1, 1, 2, 0]], logits)
    assert agr.top1_agreement == 1.0 and agr.max_abs_diff == 0.5


def test_a_tie_for_the_top_score_counts_as_argmax_does():
    """One rule everywhere: a tie goes to the first index (numpy.argmax), and ties are counted."""
    logits = np.array([[2.0, 2.0, 0.0], [0.0, 1.0, 1.0], [3.0, 0.0, 0.0]])
    labels = np.array([1, 1, 0])  # row 0 ties 0/1 → argmax says 0 (wrong); row 1 ties 1/2 → 1 (right)
    acc = classification_accuracy(logits, labels)
    assert acc.correct == int((logits.argmax(1) == labels).sum()) == 2
    assert acc.ties == 2 and format_accuracy(acc) == "66.67% (2/3 correct, 2 tied)"


@pytest.mark.slow  # over a second: `make test` runs it
def test_interference_is_detected():
    """A busy process beside the timed phase shows up as other CPU time and is flagged."""
    hog = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"])
    try:
        time.sleep(0.3)
        with CpuMonitor(threshold=0.05) as mon:
            time.sleep(1.0)
    finally:
        hog.kill()
    assert mon.report.other_cpu_s > 0.5
    assert mon.report.flagged


def test_atomic_write_and_torn_jsonl(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"x": np.float32(1.5)})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    (tmp_path / "r.jsonl").write_text('{"a": 1}\n{"b": 2}\n{"c": ')
    assert read_jsonl(tmp_path / "r.jsonl") == [{"a": 1}, {"b": 2}]


@pytest.fixture(scope="module")
def color_bench(tmp_path_factory):
    """`servopt bench` on a labelled folder whose right answers are known: 12 correct of 14."""
    tmp = tmp_path_factory.mktemp("colorbench")
    data = write_color_folder(tmp / "data", per_class=4, mislabel=2)
    model = channel_mean_onnx(tmp / "colors.onnx")
    out = tmp / "out.json"
    result = runner.invoke(app, ["bench", str(model), "--data", str(data), "--crop", "32", "--resize", "32",
                                 "--min-runs", "5", "--min-seconds", "0.05", "--batch-size", "4", "--sweep", "1,2",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.output


def test_accuracy_counted_on_known_answers(color_bench):
    report, output = color_bench
    r = report["results"][0]
    assert r["quality"]["accuracy"]["correct"] == 12 and r["quality"]["accuracy"]["total"] == 14
    assert "85.71% (12/14 correct)" in output


def test_bench_json_matches_schema(color_bench):
    report, _ = color_bench
    assert report["schema"] == "servopt.bench/2"
    for r in report["results"]:
        validate_result(r)
        assert r["latency_ms"]["n"] >= 5
        assert set(r["throughput_ips"]["sweep"]) == {"1", "2"}
        assert r["cold_start"]["total_s"] > 0 and 10 < r["cold_start"]["peak_rss_mb"] < 2000
        assert r["environment"]["session"]["provider_actual"] == "CPUExecutionProvider"
        assert r["environment"]["session"]["provider_fallback"] is False
        assert "single" in r["interference"] and "other_share" in r["interference"]["batch"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "nope.onnx"], "does not exist"),
        (["bench", "{model}", "--data", "{tmp}/missing"], "does not exist"),
        (["bench", "{model}", "--data", "{tmp}", "--split", "training"], "split 'training' not found"),
        (["bench", "{model}", "--sweep", "1,x"], "comma-separated"),
        (["bench", "{model}", "--graph-level", "max"], "graph_optimization_level"),
        (["bench", "{model}", "-o", "hint=LATENCY"], "no runtime measured here takes option(s) ['hint']"),
        (["bench", "{model}", "--runtime", "tensorflow"], "unknown runtime"),
        (["bench", "{model}", "--input-shape", "input=1xthree"], "NAME=DxDxD"),
        (["export", "{model}", "--out", "{tmp}/x.onnx"], "already ONNX"),
    ],
)
def test_cli_bad_input_gets_clear_error(tmp_path, args, message):
    model = channel_mean_onnx(tmp_path / "m.onnx")
    args = [a.format(model=model, tmp=tmp_path) for a in args]
    result = runner.invoke(app, [*args, "--min-runs", "2", "--min-seconds", "0.01"] if args[0] == "bench" else args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "fix:" in result.output
    assert "Traceback" not in result.output


def test_schema_file_is_generated_from_the_record_contract():
    """The documented schema cannot drift from the code: regenerate with `python -m servopt.results`."""
    from servopt.results import SCHEMA_FILE, result_schema

    assert json.loads(SCHEMA_FILE.read_text()) == result_schema()


def test_schema_doc_is_generated_from_the_field_descriptions():
    """docs/results-schema.md's field tables come from the contracts (`python -m servopt.results` rewrites them): a field
    added without a description, or a description changed, shows here."""
    from servopt.contracts import Record
    from servopt.results import DOC_FILE, with_schema_doc

    text = DOC_FILE.read_text()
    assert with_schema_doc(text) == text, "stale: run python -m servopt.results"
    assert all(f.description for f in Record.model_fields.values()), "every record field says what it is"


def test_version_1_records_are_read():
    """servopt 0.1 records (dicts, `servopt.result/1`) still load as typed records."""
    from servopt.results import parse_record

    v1 = {"schema": "servopt.result/1", "name": "ort-fp32", "variant": "ort-fp32", "runtime": "onnxruntime", "status": "ok",
          "error": None, "size_mb": 9.1, "batch_size": 32, "accuracy": {"top1": 0.97, "top5": 1.0, "correct": 358,
          "correct_top5": 368, "total": 368}, "agreement": None, "latency_ms": {"p50": 3.9, "p95": 4.7, "p99": 5.2, "mean": 4,
          "stdev": 0.3, "n": 100, "p50_ci95": [3.8, 4.0]}, "throughput_ips": {"single": 250, "batch": 243, "sweep": None},
          "cold_start_s": 0.16, "cold_start": {"total_s": 0.16, "imports_s": 0.1, "load_s": 0.03, "first_inference_s": 0.01,
          "peak_rss_mb": 91}, "peak_rss_mb": 91, "interference": None,
          "environment": {"cpu": "AMD EPYC", "cpu_flags": ["avx2"], "cores": 2, "gpu": False, "python": "3.11.7",
                          "libraries": {}, "session": {"runtime": "onnxruntime", "provider_requested": "CPUExecutionProvider",
                                                       "provider_actual": "CPUExecutionProvider", "provider_fallback": False,
                                                       "graph_optimization_level": "all", "intra_op_threads": "default"}},
          "load_s": 0.05, "compile_s": 0.0, "key": "abc", "group": "onnxruntime", "chain": [["export-onnx", {}]], "options": {},
          "env": {}, "description": "", "needs_gpu": False, "artifact": "/x/model.onnx", "artifact_format": "onnx", "build_s": 1.0}
    rec = parse_record(v1)
    assert rec.cold_start_s == 0.16 and rec.peak_rss_mb == 91 and rec.artifact.path == "/x/model.onnx"
    assert rec.chain[0].pass_name == "export-onnx" and rec.environment.session.details["graph_optimization_level"] == "all"
    assert rec.environment.session.threads == "default"


@pytest.mark.slow  # over a second: `make test` runs it
def test_a_stored_replay_script_reproduces_the_job(tmp_path):
    """Every job leaves replay.sh; run alone, it measures the same variant again: the same verification figures and
    session, the same phases under the same stopping rule (timings differ run to run and are not compared)."""
    from servopt.bench.jobs import MeasureJob, OpenSpec
    from servopt.bench.launcher import launch
    from servopt.bench.protocol import Protocol
    from servopt.contracts import Accuracy, Artifact, ClassificationQuality, Gate, Measured
    from servopt.data.dataset import Dataset

    x = np.random.default_rng(0).standard_normal((12, 3, 8, 8)).astype(np.float32)
    labels = x.mean(axis=(2, 3)).argmax(1)
    labels[:2] = (labels[:2] + 1) % 3  # two wrong answers, so the accuracy figures are not trivially 1.0
    Dataset({"input": x}, labels, ["r", "g", "b"], "t").save(tmp_path / "d.npz")
    np.save(tmp_path / "ref.npy", x.mean(axis=(2, 3)) + 1e-3)
    model = channel_mean_onnx(tmp_path / "m.onnx", size=8)
    job = MeasureJob(session=OpenSpec(name="m", artifact=Artifact(format="onnx", path=str(model)), runtime="onnxruntime",
                                      options={"intra_op_threads": 1}),
                     data=str(tmp_path / "d.npz"), family="image-classification", reference=str(tmp_path / "ref.npy"),
                     protocol=Protocol.quick(), gate=Gate(reference=ClassificationQuality(accuracy=Accuracy(top1=0.8, top5=1, correct=8, total=10))), env={"SERVOPT_REPLAY_TEST": "1"})
    original = launch(job, tmp_path / "job")
    assert original.result is not None, original.error
    replay = tmp_path / "job" / "replay.sh"
    assert "SERVOPT_REPLAY_TEST=1" in replay.read_text(), "the job's own environment variables travel with it"
    (tmp_path / "job" / "out.json").unlink()
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # a shell that knows nothing of this session: the script must
    done = subprocess.run(["sh", str(replay)], capture_output=True, text=True, timeout=300, cwd="/", env=bare)
    assert done.returncode == 0, done.stderr[-2000:]
    again = Measured.model_validate_json((tmp_path / "job" / "replay-out.json").read_text())
    first = original.result
    assert again.status == first.status == "ok"
    assert again.quality == first.quality and again.quality.accuracy.correct == 10 and again.quality.accuracy.total == 12
    assert again.quality.agreement.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    assert again.environment.session == first.environment.session and again.environment.session.threads == 1
    assert [p.name for p in again.phases] == [p.name for p in first.phases] and again.stopped_by.keys() == first.stopped_by.keys()
    assert again.latency_ms.n >= Protocol.quick().min_runs and again.throughput_ips.batch > 0
