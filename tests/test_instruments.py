"""The measuring instruments the benchmarks import from the library (issue 35): CPU accounting of the machine, a process
tree and its threads (bench.cputime), /metrics parsing (serve.metrics), timed
blocks across environments (bench.blocks), texts of exactly N tokens (data.text), a revision's source (serve.harness)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from servopt.bench import blocks, cputime
from servopt.serve.metrics import metrics_delta, parse_metrics

ROOT = Path(__file__).resolve().parents[1]
LINUX = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc only")


def test_proc_stat_fields_survive_odd_command_names() -> None:
    """utime and stime are fields 14 and 15 of proc(5); a command name with spaces and ')' must not shift them."""
    rest = "S 1 2 3 4 5 6 7 8 9 10 1234 56 0 0 20 0 8 0 100 0 0"
    assert cputime.proc_cpu_ticks(f"4242 (uvicorn) {rest}") == 1290
    assert cputime.proc_cpu_ticks(f"4242 (a b) c)) {rest}") == 1290
    assert cputime.proc_ppid(f"4242 (a b) c)) {rest}") == 1
    assert cputime.status_kb("Name:\tx\nVmHWM:\t  239012 kB\nVmRSS:\t 1000 kB\n", "VmHWM") == 239012
    assert cputime.status_kb("Name:\tx\n", "VmHWM") == 0


@LINUX
def test_a_process_tree_counts_its_children() -> None:
    """A server's CPU is its tree's: a child burning CPU counts in its parent's tree, and the tree names the child."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 120  # a loaded shared machine gives the child its half second slowly
        while time.monotonic() < deadline and cputime.tree_cpu_s(child.pid) < 0.4:
            time.sleep(0.05)
        assert child.pid in cputime.process_tree(os.getpid())
        child_cpu = cputime.tree_cpu_s(child.pid)
        assert child_cpu >= 0.4, f"the child used {child_cpu:.2f} s of CPU in 120 s"
        assert cputime.tree_cpu_s(os.getpid()) - cputime.own_cpu_s() >= child_cpu - 0.05  # the tree counts the child
        assert cputime.tree_kb(os.getpid(), "VmHWM") >= cputime.tree_kb(os.getpid(), "VmRSS") > 0
    finally:
        child.kill()
        child.wait()
    busy, steal = cputime.machine_busy_s()
    assert busy > 0 and steal >= 0


@LINUX
def test_thread_cpu_counts_a_named_inference_thread_while_it_runs() -> None:
    """A server's CPU split: the main thread (the event loop) and the threads named servopt-infer* (read while they
    live: an ended thread leaves /proc, as the server's executor threads do not)."""
    from servopt.serve.batcher import INFERENCE_THREAD_PREFIX, name_native_thread

    done, measured = threading.Event(), threading.Event()

    def burn() -> None:
        name_native_thread()
        end = time.process_time() + 0.4
        while time.process_time() < end:
            pass
        done.set()
        measured.wait(10)

    loop0, infer0 = cputime.thread_cpu_s(os.getpid(), INFERENCE_THREAD_PREFIX)
    t = threading.Thread(target=burn, name="servopt-infer_7")
    t.start()
    done.wait(10)
    loop1, infer1 = cputime.thread_cpu_s(os.getpid(), INFERENCE_THREAD_PREFIX)
    measured.set()
    t.join()
    assert infer1 - infer0 >= 0.3
    assert loop1 - loop0 < 0.2  # the main thread waited


def test_metrics_are_parsed_by_prefix_and_differenced() -> None:
    text = ("# HELP servopt_refused_total x\n# TYPE servopt_refused_total counter\n"
            'servopt_refused_total{reason="expected_wait"} 3.0\nservopt_batch_size_sum 64.0\nservopt_batch_size_count 4.0\n'
            "process_cpu_seconds_total 1.5\nservopt_broken nan-ish\n")
    values = parse_metrics(text)
    assert values == {'servopt_refused_total{reason="expected_wait"}': 3.0, "servopt_batch_size_sum": 64.0,
                      "servopt_batch_size_count": 4.0}
    assert parse_metrics(text, ("servopt_batch_size_count",)) == {"servopt_batch_size_count": 4.0}
    assert metrics_delta({"servopt_batch_size_sum": 60.0}, values)["servopt_batch_size_sum"] == 4.0
    assert metrics_delta({}, values)["servopt_batch_size_count"] == 4.0


def test_workloads_are_the_same_texts_for_every_side() -> None:
    inputs = {"pools": {"short": ["a", "b"], "128": ["c"]}, "b32x128": ["x"] * 32, "short": "s", "texts": ["t", "u"]}
    assert blocks.workload(inputs, "pool:short:8") == (["a", "b"], 8)
    assert blocks.workload(inputs, "b1short") == (["s"], 1)
    assert blocks.workload(inputs, "texts") == (["t", "u"], 32)
    with pytest.raises(ValueError, match="unknown workload"):
        blocks.workload(inputs, "nope")


def test_a_block_worker_answers_blocks_and_reports_a_failing_command(tmp_path: Path) -> None:
    """The controller asks a worker in another process (as in a peer's environment, servopt's src on PYTHONPATH) for a
    timed block; a command naming no backend answers ok: false and the worker goes on."""
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"texts": ["a", "bb"], "short": "s", "b32x128": ["x"] * 32}))
    code = ("import json, sys, numpy as np\nfrom servopt.bench import blocks\nout = blocks.protocol_channel()\n"
            "print('noise a library prints')\n"
            f"inputs = json.load(open({str(inputs)!r}))\n"
            "blocks.answer_blocks({'len': lambda t, b: np.array([[len(x)] for x in t], np.float32)}, inputs, {'side': 'fake'}, out)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    worker = blocks.BlockWorker("fake", [sys.executable, "-c", code], env, tmp_path / "worker.log")
    try:
        assert worker.answer(60) == {"ready": True, "side": "fake"}
        block = worker.ask({"op": "block", "backend": "len", "workload": "texts", "min_calls": 3, "min_seconds": 0.01,
                            "max_seconds": 5}, 60)
        assert block["ok"] and len(block["times_ns"]) >= 3 and block["items_per_call"] == 2 and block["stopped_by"] == "rule"
        failed = worker.ask({"op": "block", "backend": "missing", "workload": "texts"}, 60)
        assert not failed["ok"] and "missing" in failed["error"]
        worker.ask({"op": "embed", "backend": "len", "out": str(tmp_path / "e.npy")}, 60)
        assert np.load(tmp_path / "e.npy").tolist() == [[1.0], [2.0]]
        assert worker.cpu_s() > 0
    finally:
        worker.stop()
    assert worker.proc.returncode == 0 and "noise a library prints" in (tmp_path / "worker.log").read_text()


def test_texts_of_exactly_n_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from servopt.data.text import TextTokenizer, exact_length_texts
    from servopt.errors import UserError

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "on", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(tmp_path / "tokenizer.json"))
    text_tok = TextTokenizer(tmp_path / "tokenizer.json", max_length=8)  # shorter than the texts asked for: not a limit
    texts = exact_length_texts(text_tok, ["the", "cat", "sat", "on", "the", "mat"], 3, 12)
    assert len(texts) == 3 and len(set(texts)) > 1  # each starts at another word
    assert [e.full_length for e in text_tok.encode(texts)] == [12, 12, 12]
    with pytest.raises(UserError, match="no words"):
        exact_length_texts(text_tok, [], 1, 12)
    with pytest.raises(UserError, match="exactly 1 tokens"):
        exact_length_texts(text_tok, ["the"], 1, 1)


def test_a_revisions_src_is_checked_out_into_a_cache_made_on_demand(tmp_path: Path) -> None:
    """Two versions of the server in one run: the other revision's server runs from its archived src."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    from servopt.serve.harness import revision_src

    src = revision_src("HEAD", tmp_path / "not-yet" / "revisions")
    assert (src / "servopt" / "serve" / "batcher.py").is_file()
    assert revision_src("HEAD", tmp_path / "not-yet" / "revisions") == src  # cached: archived once


def test_any_server_runs_until_it_answers_and_a_dead_one_says_why(tmp_path: Path) -> None:
    """AppProcess runs a server from any command (a peer's in its own environment), ready at its first 200, with its
    tree's CPU and memory; one that exits while starting raises with its output."""
    from servopt.serve.harness import AppProcess, free_port

    port = free_port()
    (tmp_path / "ready").write_text("ok")
    with AppProcess([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], port, cwd=tmp_path,
                    ready_path="/ready", start_timeout_s=60) as app:
        assert app.start_s > 0 and app.cpu_seconds() > 0 and app.rss_bytes() > 0
        assert app.peak_rss_bytes() >= app.rss_bytes() or not Path("/proc").exists()
    assert app.proc.poll() is not None
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 0 while starting.*no server here"):
        AppProcess([sys.executable, "-c", "print('no server here')"], free_port(), start_timeout_s=30)


@LINUX
def test_a_server_dies_with_the_process_that_started_it_even_on_kill_9(tmp_path: Path) -> None:
    """kill -9 of a sweep during its capacity search left its `servopt serve` running beside whatever measured next:
    a server started by ``AppProcess`` gets SIGTERM from the kernel when its starter dies (``dies_with_this_process``)."""
    code = ("import sys, time\nfrom servopt.serve.harness import AppProcess, free_port\nport = free_port()\n"
            "app = AppProcess([sys.executable, '-m', 'http.server', str(port), '--bind', '127.0.0.1'], port, ready_path='/',"
            " start_timeout_s=60)\nprint(app.proc.pid, flush=True)\ntime.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert parent.stdout is not None
        server = int(parent.stdout.readline())
        assert Path(f"/proc/{server}").exists()
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Path(f"/proc/{server}").exists():
            status = Path(f"/proc/{server}/status").read_text() if Path(f"/proc/{server}/status").exists() else ""
            if "State:\tZ" in status:  # gone, waiting to be reaped by init
                break
            time.sleep(0.1)
        alive = Path(f"/proc/{server}/status").exists() and "State:\tZ" not in Path(f"/proc/{server}/status").read_text()
        assert not alive, "the server outlived the process that started it"
    finally:
        parent.kill()
        if "server" in locals():
            subprocess.run(["kill", "-9", str(server)], capture_output=True)  # an orphan of a failed run


def test_servopts_text_encoder_batches_by_length_and_answers_in_input_order(tmp_path: Path) -> None:
    """The offline side of a text comparison: length-sorted batches, each padded to its own longest, rows back in the
    order the texts came."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from servopt.families.text import text_encoder
    from servopt.spec import ModelSpec, TensorSpec

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(tmp_path / "tokenizer.json"))
    ids = [TensorSpec(name=n, dtype="int64", shape=["batch", "sequence"]) for n in ("input_ids", "attention_mask")]
    spec = ModelSpec(inputs=ids, outputs=[TensorSpec(name="e", dtype="float32", shape=["batch", 2])], task="embedding",
                     preprocessing={"tokenizer": str(tmp_path / "tokenizer.json"), "max_length": 32})
    widths: list[int] = []

    class Session:
        def run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
            widths.append(feed["input_ids"].shape[1])
            n = feed["attention_mask"].sum(1).astype(np.float32)
            return np.stack([n, n], axis=1)

    texts = ["a " * 9, "a", "a " * 5, "b b"]  # 11, 3, 7 and 4 tokens
    out = text_encoder(spec, Session())(texts, 2)
    assert out[:, 0].tolist() == [11, 3, 7, 4]
    assert sorted(widths) == [4, 11]  # (3, 4) and (7, 11): each batch padded to its own longest


@pytest.mark.isa
def test_the_machine_header_names_the_cpu_its_cores_features_and_cap() -> None:
    from servopt.contracts import Environment
    from servopt.machine import header

    env = Environment(cpu="Some Xeon", cpu_flags=["avx2", "fma", "avx512f", "avx512_vnni"], cores=8, cores_usable=2,
                      isa_cap="avx2")
    line = header(env)
    assert line.startswith("Some Xeon, 8 cores (2 usable), avx512_vnni") and "VNNI" in line and line.endswith("capped at avx2")
    assert header(Environment(cpu="Other", cores=2)) == "Other, 2 cores, flags unknown"
    assert header().split(",")[0]  # this machine's


def test_a_records_measure_job_runs_it_as_it_ran_with_an_env_over_its_own() -> None:
    """What alternating.py and isa_cap.py alternate: the record's artifact, runtime, options and environment, and a cap
    laid over that environment; a record with nothing built cannot be measured."""
    from servopt.bench.jobs import MeasureJob
    from servopt.bench.protocol import Protocol
    from servopt.contracts import Artifact, Record

    rec = Record(name="v", runtime="openvino", status="ok", options={"hint": "LATENCY"}, env={"A": "1", "B": "2"},
                 artifact=Artifact(format="openvino", path="/x/model.xml"))
    job = MeasureJob.of_record(rec, Path("/run/data/eval.npz"), "image-classification", Protocol(), {"B": "capped"})
    assert (job.session.name, job.session.runtime, job.session.options) == ("v", "openvino", {"hint": "LATENCY"})
    assert job.session.artifact.path == "/x/model.xml" and job.data == "/run/data/eval.npz"
    assert job.env == {"A": "1", "B": "capped"} and rec.env == {"A": "1", "B": "2"}
    with pytest.raises(ValueError, match="no artifact"):
        MeasureJob.of_record(Record(name="w", runtime="onnxruntime", status="failed"), "d.npz", "x", Protocol())
