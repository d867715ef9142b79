"""A run that resumes, stops cleanly and binds its budget (issues 33 and 34): the launcher's process groups, deadlines
and stop; resuming with the progress bar on after kill -9; plain progress in a log; SIGINT/SIGTERM mid-build and
mid-measurement leave no process behind and an interrupted summary that a rerun finishes; a build past the budget is
listed as not finished, never recorded as failed."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from typer.testing import CliRunner

from servopt.bench import launcher
from servopt.bench.jobs import OpenSpec, ProfileJob
from servopt.cli import app
from servopt.contracts import Artifact

runner = CliRunner()
SRC = str(Path(__file__).parents[1] / "src")


# ----------------------------------------------------------------------------------------------- the launcher
def _hanging_job(tmp_path: Path) -> tuple[ProfileJob, Path]:
    """A job whose 'interpreter' starts a child of its own and then hangs: what a stuck build looks like from outside."""
    fake = tmp_path / "fake-python"
    pidfile = tmp_path / "grandchild.pid"
    fake.write_text(f"#!/bin/sh\nsleep 120 &\necho $! > {pidfile}\nsleep 120\n")
    fake.chmod(0o755)
    job = ProfileJob(session=OpenSpec(name="x", artifact=Artifact(format="onnx", path=str(tmp_path / "x.onnx")), runtime="onnxruntime"),
                     data=str(tmp_path / "d.npz"), python=str(fake))
    return job, pidfile


def _gone(pid: int, within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _wait_for(path: Path, within: float = 10.0) -> str:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_a_job_past_its_deadline_is_stopped_with_its_children_and_says_out_of_time(tmp_path):
    job, pidfile = _hanging_job(tmp_path)
    started = time.monotonic()
    with pytest.raises(launcher.OutOfTime, match="time budget"):
        launcher.launch(job, tmp_path / "job", deadline=time.time() + 1.5)
    assert time.monotonic() - started < 30, "stopped at the deadline, not at the job's own time limit"
    assert _gone(int(pidfile.read_text())), "the job's own child went with it (its process group)"
    with pytest.raises(launcher.OutOfTime, match="not started"):  # nothing is started once the budget is spent
        launcher.launch(job, tmp_path / "late", deadline=time.time() - 1)
    assert not (tmp_path / "late").exists()


def test_stop_all_kills_the_running_jobs_process_groups_and_refuses_new_ones(tmp_path):
    import threading

    job, pidfile = _hanging_job(tmp_path)
    caught: list[BaseException] = []

    def run() -> None:
        try:
            launcher.launch(job, tmp_path / "job")
        except BaseException as e:  # noqa: BLE001
            caught.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    grandchild = int(_wait_for(pidfile))
    try:
        assert launcher.stop_all() == 1
        worker.join(10)
        assert not worker.is_alive() and isinstance(caught[0], launcher.Interrupted), caught
        assert _gone(grandchild)
        with pytest.raises(launcher.Interrupted):
            launcher.launch(job, tmp_path / "after")
    finally:
        launcher.reset_stop()


# ----------------------------------------------------------------------------------------------- progress
def test_the_progress_bar_counts_a_resumed_runs_cached_records_before_it_starts(monkeypatch):
    """A resumed run advances for each cached record before the bar has its total: that once raised KeyError('id')."""
    from rich.console import Console

    import servopt.cli.optimize as cli

    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), force_terminal=True))
    bar, callbacks = cli._progress_ui(False)
    assert bar is not None
    callbacks.advance()
    callbacks.advance()
    callbacks.start(5)
    callbacks.advance()
    assert bar.tasks[0].completed == 3 and bar.tasks[0].total == 5


def test_the_progress_bar_s_time_left_never_runs_past_the_budget(monkeypatch):
    """A 1-minute budget's bar said ETA 0:08:24 from the first variants' pace: the sweep stops at the budget's end, so
    the estimate shown is the smaller of the two (marked), and rich's own where it is the smaller."""
    from types import SimpleNamespace

    import servopt.cli.optimize as cli

    column = cli._BudgetRemaining()
    column.left = lambda: 60.0  # what Sweep.left(closing=False) says
    slow = SimpleNamespace(finished=False, time_remaining=504.0, total=29, completed=2, speed=None, elapsed=40.0)
    shown = column.render(slow).plain
    assert "(budget)" in shown and shown.startswith(("0:00:", "0:01:00")), shown
    quick = SimpleNamespace(finished=False, time_remaining=5.0, total=29, completed=27, speed=None, elapsed=40.0)
    assert "(budget)" not in column.render(quick).plain
    assert "(budget)" not in cli._BudgetRemaining().render(slow).plain, "no budget: rich's estimate"


def test_default_budget_and_full_lifts_it():
    from servopt.cli.optimize import optimize_settings

    assert optimize_settings().budget_seconds == 30 * 60
    assert optimize_settings(budget="none").budget_seconds is None
    assert optimize_settings(full=True).budget_seconds is None
    assert optimize_settings(full=True, budget="5m").budget_seconds == 300


def test_a_refinement_ladder_gives_up_when_the_rest_cannot_recover_the_points():
    from servopt.optimize.racing import refinement_hopeless

    assert refinement_hopeless([9.0, 8.0], 1.0, tried=1) is None, "not before two rungs"
    assert refinement_hopeless([9.0, 8.0, 4.0], 1.0, tried=2) == (
        "after 2 refinements the best still loses 4.00 points, more than 3× the 1 tolerated: a search cannot plausibly "
        "recover that with INT8 kernels (--full builds it)")
    assert refinement_hopeless([9.0, 8.0, 2.5], 1.0, tried=2) is None, "within reach: go on"
    assert refinement_hopeless([None, None, None], 1.0, tried=2) is None


def test_a_refinement_ladder_gives_up_when_every_rung_misses_the_gate_by_far():
    """Variants that failed verification have no drop the targets read: the ladder reads how far they missed the gate,
    in units of what the gate allows, and goes on while one rung came near."""
    from servopt.contracts import ClassificationQuality, Gate
    from servopt.families import FAMILIES
    from servopt.optimize.racing import refinement_hopeless

    image = FAMILIES.get("image-classification")
    gate = Gate(min_agreement=0.9)

    def agreeing(overall: float, confident: float | None = None, confident_total: int = 0) -> ClassificationQuality:
        return ClassificationQuality.model_validate({"agreement": {
            "top1_agreement": overall, "top1_agreement_confident": confident, "confident_total": confident_total}})

    assert image.gate_shortfall(agreeing(0.64), gate) == pytest.approx(2.6)
    assert image.gate_shortfall(agreeing(0.95), gate) == 0.0
    # the gate reads the confident samples' agreement where there are enough of them: so does the shortfall
    assert image.gate_shortfall(agreeing(0.64, 0.98, 40), gate) == 0.0
    assert image.gate_shortfall(agreeing(0.64, 0.98, 10), gate) == pytest.approx(2.6)
    why = refinement_hopeless([None, None, None], 1.0, tried=2, shortfalls=[2.6, 2.4, 2.5])
    assert why is not None and "misses the verification gate by 2.4× what it allows" in why
    assert refinement_hopeless([None, None], 1.0, tried=1, shortfalls=[2.6, 2.4]) is None, "not before two rungs"
    assert refinement_hopeless([None, None, None], 1.0, tried=2, shortfalls=[2.6, 1.5, 2.5]) is None, "one within reach"
    assert refinement_hopeless([None, None, None], 1.0, tried=2, shortfalls=[2.6, None, 2.5]) is None, "one not judged"
    # text encoders: the lowest of the means the gate holds (batched, alone, batch consistency) against min_cosine
    from servopt.contracts import EmbeddingQuality

    text = FAMILIES.get("text-embedding")
    q = EmbeddingQuality.model_validate({"agreement": {"cosine_mean": 0.995, "batch_consistency": 0.86}})
    assert text.gate_shortfall(q, Gate(min_cosine=0.99)) == pytest.approx(13.0)


# ----------------------------------------------------------------------------------------------- whole runs
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv2(torch.relu(self.conv1(x)))).mean((2, 3)))


@pytest.fixture(scope="module")
def small(tmp_path_factory, digits) -> dict:
    """An untrained 16×16 CNN (its speed and its builds are what these tests need, not its accuracy) and the digits
    (the session's: conftest)."""
    root = tmp_path_factory.mktemp("interrupt")
    torch.manual_seed(0)
    path = root / "net.onnx"
    torch.onnx.export(_Net().eval(), (torch.zeros(1, 3, 16, 16),), str(path), dynamo=False, input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17)
    return {"path": path, "digits": digits}


# A build (two at a time) and measurements to stop and resume: three variants are enough (a fourth, static INT8 QDQ,
# added a build and a measurement to each of the eight sweeps of the kill and signal tests)
VARIANTS = ["ort-fp32", "ort-offline-all", "ort-int8-static-qop-u8s8"]


def _cmd(small: dict, out: Path, *extra: str) -> list[str]:
    cmd = ["optimize", str(small["path"]), "--data", str(small["digits"]), "--crop", "16", "--out", str(out), "--targets", "edge",
           "--limit", "60", "--calibration-samples", "16", "--quick", *extra]
    return cmd + [a for v in VARIANTS for a in ("--variants", v)]


def _start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONPATH": SRC, **env}
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "servopt", *cmd], env=full_env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _job_running(proc: subprocess.Popen, job: str, within: float = 240.0) -> list[psutil.Process]:
    """Wait until ``proc`` runs a ``job`` (build, measure) process; then every process under it."""
    parent = psutil.Process(proc.pid)
    end = time.monotonic() + within
    while time.monotonic() < end and proc.poll() is None:
        try:
            below = parent.children(recursive=True)
            if any(f"/{job}/job.json" in " ".join(p.cmdline()) for p in below):
                return below
        except psutil.Error:
            pass
        time.sleep(0.02)
    raise AssertionError(f"no {job} process seen (the run exited {proc.poll()})")


def _results(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("job", ["build", "measure"])
def test_resume_after_kill_9_with_the_progress_bar_on(tmp_path, small, job):
    """The README's promise with the progress bar drawn (FORCE_COLOR: a terminal, as a user runs it): kill -9 during a
    build or a measurement, run the same command again: it finishes, nothing measured twice, no job process left over."""
    out = tmp_path / "run"
    cmd = _cmd(small, out)
    proc = _start(cmd, tmp_path / "first.log", FORCE_COLOR="1")
    if job == "measure":  # past the original's measurement, so the rerun has a cached record to advance the bar with
        end = time.monotonic() + 240
        while not _results(out) and time.monotonic() < end:
            time.sleep(0.05)
    below = _job_running(proc, job)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert all(_gone(p.pid) for p in below), "a job died with the sweep (no orphan measuring or building on)"
    before = _results(out)
    assert len(before) < len(VARIANTS), "killed mid-sweep"
    again = _start(cmd, tmp_path / "again.log", FORCE_COLOR="1")
    assert again.wait(timeout=600) == 0, (tmp_path / "again.log").read_text()[-3000:]
    names = [r["name"] for r in _results(out)]
    assert sorted(names) == sorted(VARIANTS), "nothing measured twice, nothing left out"
    assert json.loads((out / "summary.json").read_text())["interrupted"] is False


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "job"), [(signal.SIGINT, "build"), (signal.SIGTERM, "measure")])
def test_a_signal_stops_every_job_writes_an_interrupted_summary_and_a_rerun_finishes(tmp_path, small, sig, job):
    """SIGINT (Ctrl-C) or SIGTERM to `servopt optimize` during a build or a measurement: no process it started survives,
    summary.json and the reports say interrupted and list what was not finished, and the same command finishes. Its
    output goes to a log: one plain line per step and per result."""
    out = tmp_path / "run"
    cmd = _cmd(small, out)
    log = tmp_path / "first.log"
    proc = _start(cmd, log)
    if job == "measure":
        end = time.monotonic() + 240
        while not any(r["name"] != "ort-fp32" for r in _results(out)) and time.monotonic() < end:
            time.sleep(0.05)
    below = _job_running(proc, job)
    os.kill(proc.pid, sig)  # the sweep alone, as `kill` does; a terminal's Ctrl-C reaches only it too (jobs: own groups)
    code = proc.wait(timeout=120)
    text = log.read_text()
    assert code == 128 + sig, text[-3000:]
    assert all(_gone(p.pid) for p in below), [p.pid for p in below if not _gone(p.pid, 0)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    measured = {r["name"] for r in _results(out)}
    unfinished = {v["name"] for v in summary["not_tried"] if v["why"].startswith("not finished")}
    assert unfinished and unfinished == set(VARIANTS) - measured, (unfinished, measured)
    assert not any(r["status"] == "failed" for r in _results(out)), "a killed job is not a failure a resume would trust"
    assert "INTERRUPTED" in (out / "report.md").read_text() and "INTERRUPTED" in (out / "report.html").read_text()
    assert "INTERRUPTED" in text and "measuring ort-fp32" in text, "the terminal says so too; the log has plain lines"
    assert "ort-fp32: ok, quality" in text and " p50 " in text
    again = runner.invoke(app, [*cmd, "--quiet"])
    assert again.exit_code == 0, again.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is False and summary["counts"]["ok"] == len(VARIANTS)
    assert sorted(r["name"] for r in _results(out)) == sorted(VARIANTS)


@pytest.mark.slow
def test_a_build_past_the_budget_is_listed_as_not_finished_and_a_larger_budget_builds_it(tmp_path, small, monkeypatch):
    """Builds started under --budget get its end as a deadline: here a deadline just after they start (a budget that
    runs out mid-build), so both builds are stopped: listed in not_tried, no failed record; the rerun builds them."""
    from servopt.optimize.budget import Budget

    real = Budget.deadline
    monkeypatch.setattr(Budget, "deadline", lambda self, v: None if real(self, v) is None else time.time() + 0.3)
    out = tmp_path / "run"
    variants = ["ort-fp32", "ort-offline-all", "ort-int8-static-qop-u8s8"]
    cmd = _cmd(small, out, "--quiet", "--budget", "1h")
    cmd = cmd[:cmd.index("--variants")] + [a for v in variants for a in ("--variants", v)]
    result = runner.invoke(app, cmd)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    why = {v["name"]: v["why"] for v in summary["not_tried"]}
    assert set(why) == {"ort-offline-all", "ort-int8-static-qop-u8s8"}, why
    assert all(w.startswith("not finished: stopped at the time budget's end") and "--budget" in w for w in why.values()), why
    assert [r["name"] for r in _results(out)] == ["ort-fp32"], "no failed record a resume would trust"
    monkeypatch.setattr(Budget, "deadline", real)
    result = runner.invoke(app, cmd)
    assert result.exit_code == 0, result.output
    assert sorted(r["name"] for r in _results(out)) == sorted(variants)
    assert json.loads((out / "summary.json").read_text())["not_tried"] == []


@pytest.mark.slow
def test_a_ray_executor_stopped_cancels_its_tasks_and_submits_nothing_more():
    """--ray: SIGINT/SIGTERM cancels the tasks under way (their workers killed, their jobs with them) and they come back
    Interrupted, not Lost (no failed record); nothing is submitted after."""
    ray = pytest.importorskip("ray")
    from servopt.optimize.ray_executor import RayExecutor

    ray.init(num_cpus=1, resources={"servopt_slot": 1}, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        with RayExecutor(owned=False) as executor:
            assert executor.submit(os.getpid, what="warm up").result(timeout=120)
            sleeping = executor.submit(time.sleep, 120, what="a long job")
            time.sleep(2)
            started = time.monotonic()
            executor.stop()
            with pytest.raises(launcher.Interrupted):
                sleeping.result(timeout=60)
            assert time.monotonic() - started < 60
            with pytest.raises(launcher.Interrupted):
                executor.submit(os.getpid, what="after the stop")
    finally:
        ray.shutdown()


@pytest.mark.isa
def test_a_hopeless_refinement_ladder_tries_its_cheap_rungs_and_skips_its_searches(monkeypatch):
    """Plain INT8 loses 10 points, and two cheap rungs still 5 (5× the 1 tolerated): the calibration search and the
    accuracy-aware search (minutes each) are listed as not built, with why; every cheap rung is still tried."""
    from conftest import no_budget
    from servopt.contracts import Accuracy, ClassificationQuality, Latency, Record, Throughput
    from servopt.cpu import CpuFeatures
    from servopt.families import FAMILIES
    from servopt.optimize.sweep import Sweep, Unit
    from servopt.optimize.targets import Target
    from servopt.optimize.variants import Variant
    from servopt.settings import OptimizeSettings

    def rec(name: str, top1: float, p50: float) -> Record:
        return Record(name=name, runtime="onnxruntime", status="ok", size_mb=1.0, latency_ms=Latency(p50=p50),
                      throughput_ips=Throughput(batch=1000 / p50),
                      quality=ClassificationQuality(accuracy=Accuracy(top1=top1, correct=int(top1 * 1000), total=1000, top5=1)))

    base = "ort-int8-static-qop-u8s8"
    static = ("ort-quantize-static", {})
    ladder = [Variant("ort-int8-entropy", "int8", "onnxruntime", [static], refines=base),
              Variant("ort-int8-percentile", "int8", "onnxruntime", [static], refines=base),
              Variant("ort-int8-nncf", "int8", "onnxruntime", [static], refines=base),
              Variant("ort-int8-calibration-search", "int8", "onnxruntime", [("ort-quantize-calibration-search", {})], refines=base),
              Variant("ort-int8-accuracy-aware", "int8", "onnxruntime", [("ort-quantize-accuracy-aware", {})], refines=base,
                      same_kernels=False)]
    sweep = object.__new__(Sweep)  # the ladder's logic alone: no model, no process
    sweep.settings, sweep.family, sweep.distributed, sweep.not_tried = OptimizeSettings(), FAMILIES.get("image-classification"), False, []
    sweep.targets = [Target(name="t", hardware="h", device="cpu", max_accuracy_drop=1.0)]
    sweep.baseline = Variant("ort-fp32", "fp32", "onnxruntime", [])  # its calls size a search's planned time
    ref = rec("ort-fp32", 0.90, 2.0)
    sweep.references = {None: ref}
    sweep.records = {("ort-fp32", None): ref, (base, None): rec(base, 0.80, 1.0)}
    sweep.budget = no_budget()
    sweep.budget.observe_baseline(ref)
    # a VNNI CPU: every rung's U8S8 computes right, so the ladder keeps the catalogue's order (test_racing covers the other)
    sweep.int8_cpu = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni"}))
    screened: list[str] = []

    def screen(units: list[Unit]) -> None:
        for u in units:
            screened.append(u.variant.name)
            sweep.records[(u.variant.name, None)] = rec(u.variant.name, 0.85, 1.0)

    monkeypatch.setattr(sweep, "_screen", screen, raising=False)
    sweep._refine([Unit(v, None, v.name) for v in ladder])
    assert screened == ["ort-int8-entropy", "ort-int8-percentile", "ort-int8-nncf"]
    skipped = {v.name: v.why for v in sweep.not_tried}
    assert set(skipped) == {"ort-int8-calibration-search", "ort-int8-accuracy-aware"}, skipped
    assert all("a search of about" in w and "more than 3× the 1 tolerated" in w for w in skipped.values()), skipped


@pytest.mark.slow
def test_a_server_the_sweep_started_is_stopped_with_its_jobs(small):
    """The capacity search serves a pick in a `servopt serve` process (serve.harness.ServerProcess), not a job: it is
    tracked, so a stop kills it at once instead of letting the search go on against it."""
    from servopt.serve.harness import ServerProcess

    server = ServerProcess(small["path"], "--name", "m")
    try:
        assert launcher.stop_all() >= 1
        assert _gone(server.proc.pid), "the server went with the stop"
    finally:
        launcher.reset_stop()
        server.stop()


@pytest.mark.slow
def test_the_finish_binds_the_budget_too(tmp_path, small, monkeypatch):
    """The finish's jobs (the side-by-side re-measure, cold starts, profiles) get the budget's end as a deadline too: a
    model whose calls outgrow the plan (MPNet's re-measure took 2 of a 10-minute budget's minutes) must not run past
    it. Here the finish's deadline comes just after it starts: the run still answers, on the screening figures, says
    what the budget stopped, stores no re-measure a resume would trust, and a rerun with time re-measures."""
    from servopt.optimize.budget import Budget

    real = Budget.finish_deadline
    monkeypatch.setattr(Budget, "finish_deadline", lambda self, stage="re-measure": time.time() + 0.3)
    out = tmp_path / "run"
    cmd = _cmd(small, out, "--quiet", "--budget", "1h", "--no-capacity")
    cmd = cmd[:cmd.index("--variants")] + [a for v in ["ort-fp32", "ort-offline-all"] for a in ("--variants", v)]
    result = runner.invoke(app, cmd)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["targets"][0]["recommended"] or summary["targets"][0]["nearest"]
    assert summary["interleaved"] is None and not list(out.glob("interleave*.json")), "nothing stored a resume would trust"
    assert any("side-by-side re-measure" in p and ("time budget" in p) for p in summary["problems"]), summary["problems"]
    monkeypatch.setattr(Budget, "finish_deadline", real)
    result = runner.invoke(app, cmd)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "summary.json").read_text())["interleaved"] is not None
