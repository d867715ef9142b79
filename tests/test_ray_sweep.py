"""``servopt optimize --ray``: a distributed sweep on a simulated Ray cluster of two nodes of different kinds.

One cluster for the module (``ray.cluster_utils.Cluster``): a head declaring ``{"servopt_slot": 1, "epyc-7763": 1}``
and a worker declaring ``{"servopt_slot": 1, "xeon-8480": 1}``, one CPU each, both on this machine (so they share a
host name: records tell them apart by ``SERVOPT_NODE``). Two CPU targets name those resources. The sweep is tiny
(three variants, ``--quick``). HOME and TMPDIR point into the test sandbox (conftest), and Ray's session folder
follows TMPDIR (checked); the cluster is shut down at the end.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servopt.cli import app
from servopt.contracts import Accuracy, ClassificationQuality, Environment, Latency, Record, Throughput
from servopt.families import FAMILIES
from servopt.optimize.decide import decide, for_target
from servopt.optimize.targets import Target, load_targets, measurement_kind

runner = CliRunner()
VARIANTS = ["ort-fp32", "ort-offline-all", "ort-int8-static-qop-u8s8"]  # the INT8 one fails verification (outlier channel)
KINDS = {"epyc": "epyc-7763", "xeon": "xeon-8480"}
TARGETS = """targets:
  - name: epyc
    hardware: AMD EPYC 7763
    device: cpu
    max_p50_ms: 1000
    ray_resources: {epyc-7763: 1}
  - name: xeon
    hardware: Intel Xeon Platinum 8480
    device: cpu
    objective: latency
    max_p50_ms: 1000
    ray_resources: {"xeon-8480": 1}
"""
SRC = str(Path(__file__).parents[1] / "src")


def _cmd(model: Path, data: Path, out: Path, targets: Path, variants: list[str] = VARIANTS) -> list[str]:
    cmd = ["optimize", str(model), "--data", str(data), "--crop", "16", "--out", str(out), "--targets", str(targets),
           "--limit", "120", "--calibration-samples", "32", "--quiet", "--quick"]
    return cmd + [a for v in variants for a in ("--variants", v)]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _tasks(out: Path) -> list[dict]:
    path = out / "work" / "ray-tasks.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _ends_within(proc, seconds: float) -> bool:
    """Whether a process (not our child) is gone or a zombie within ``seconds``."""
    import psutil

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.01)
    return False


# -- without a cluster ----------------------------------------------------------------------------------------------
def test_ray_without_ray_is_a_clear_error(tmp_path, monkeypatch):
    """Ray made unimportable: --ray stops at once and names the extra to install."""
    monkeypatch.setitem(sys.modules, "ray", None)
    result = runner.invoke(app, ["optimize", str(tmp_path / "missing.onnx"), "--ray", "auto", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert "--ray needs Ray" in result.output and "pip install 'servopt[ray]'" in result.output


def test_kinds_are_stable_labels_of_resources(tmp_path):
    assert measurement_kind(None) is None and measurement_kind({}) is None
    assert measurement_kind({"epyc-7763": 1}) == "epyc-7763"
    assert measurement_kind({"a100": 1, "GPU": 1}) == measurement_kind({"GPU": 1.0, "a100": 1}) == "GPU+a100"
    assert measurement_kind({"GPU": 0.5}) == "GPU=0.5"
    path = tmp_path / "t.yaml"
    path.write_text(TARGETS)
    assert [t.kind for t in load_targets(str(path))] == ["epyc-7763", "xeon-8480"]


def test_a_target_is_decided_only_on_its_kind_of_node():
    """Pure: the same records decide the same anywhere; each target sees only what was measured for its kind."""
    images = FAMILIES.get("image-classification")

    def rec(name: str, p50: float, kind: str | None) -> Record:
        return Record(name=name, runtime="onnxruntime", status="ok", size_mb=1, latency_ms=Latency(p50=p50),
                      throughput_ips=Throughput(batch=1000 / p50), quality=ClassificationQuality(accuracy=Accuracy(top1=0.9, correct=9, total=10, top5=1)),
                      environment=Environment(cpu=kind or "here", node=f"node-{kind}"), measured_for=kind)

    epyc = Target(name="e", hardware="EPYC", device="cpu", objective="latency", ray_resources={"epyc-7763": 1})
    xeon = Target(name="x", hardware="Xeon", device="cpu", objective="latency", ray_resources={"xeon-8480": 1})
    records = [rec("ref", 5, "epyc-7763"), rec("a", 1, "epyc-7763"), rec("b", 3, "epyc-7763"),
               rec("ref", 5, "xeon-8480"), rec("a", 4, "xeon-8480"), rec("b", 2, "xeon-8480")]
    assert [r.measured_for for r in for_target(xeon, records)] == ["xeon-8480"] * 3
    e = decide(epyc, records, records[0], images)
    x = decide(xeon, records, records[3], images)
    assert e.recommended == "a" and e.result.measured_for == "epyc-7763" and "on node node-epyc-7763" in e.reason
    assert x.recommended == "b" and x.result.measured_for == "xeon-8480"
    assert {v.variant for v in x.verdicts} == {"ref", "a", "b"}  # three verdicts, not six
    one_machine = [r.model_copy(update={"measured_for": None}) for r in records[:3]]
    assert decide(xeon, one_machine, one_machine[0], images).recommended == "a"  # one machine: every record, every target


class FakeCluster:
    """A distributed executor without Ray: every job here, one at a time, in a thread (``submit`` returns at once, as
    Ray's does); ``lose`` names jobs to come back as lost, as after a node died and the retries ran out."""

    distributed = True

    def __init__(self, lose: tuple[str, ...] = ()) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool, self.lose, self.ran = ThreadPoolExecutor(1), lose, []

    def prepare(self, run_dir, kinds) -> None:
        self.kinds = kinds

    def submit(self, fn, *args, resources=None, what="", exclusive=True):
        from concurrent.futures import Future

        from servopt.optimize.executor import LOST, Lost

        self.ran.append(what)
        if what in self.lose:
            lost: Future = Future()
            lost.set_exception(Lost(f"{LOST}: WorkerCrashedError after 3 attempts: injected"))
            return lost
        return self.pool.submit(fn, *args)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown()


@pytest.mark.slow
def test_a_lost_variant_is_recorded_failed_then_measured_again_on_rerun(trained, digits, targets_file, tmp_path, monkeypatch):
    """The runner's distributed path, without Ray: a measurement lost for one kind is a failed record saying why, the
    sweep goes on, and the same command measures that one again (and nothing else)."""
    import servopt.optimize.sweep

    out, lose = tmp_path / "lost", "measure ort-offline-all for xeon-8480"
    first = FakeCluster(lose=(lose,))
    monkeypatch.setattr(servopt.optimize.sweep, "open_executor", lambda address: first)
    result = runner.invoke(app, _cmd(trained["path"], digits, out, targets_file))
    assert result.exit_code == 0, result.output
    assert first.kinds == {"epyc-7763": {"epyc-7763": 1.0}, "xeon-8480": {"xeon-8480": 1.0}}
    records = {(r["name"], r["measured_for"]): r for r in _records(out)}
    assert len(records) == 6 and records[("ort-offline-all", "xeon-8480")]["status"] == "failed"
    assert records[("ort-offline-all", "xeon-8480")]["error"].startswith("job lost: WorkerCrashedError after 3 attempts")
    assert records[("ort-offline-all", "epyc-7763")]["status"] == "ok"
    summary = json.loads((out / "summary.json").read_text())
    assert [len(d["verdicts"]) for d in summary["targets"]] == [2, 1]  # xeon: decided on what it has
    again = FakeCluster()
    monkeypatch.setattr(servopt.optimize.sweep, "open_executor", lambda address: again)
    result = runner.invoke(app, _cmd(trained["path"], digits, out, targets_file))
    assert result.exit_code == 0, result.output
    assert [w for w in again.ran if w.startswith(("measure", "build"))] == [lose]
    latest = {(r["name"], r["measured_for"]): r for r in _records(out)}
    assert len(_records(out)) == 7 and latest[("ort-offline-all", "xeon-8480")]["status"] == "ok"
    assert [len(d["verdicts"]) for d in json.loads((out / "summary.json").read_text())["targets"]] == [2, 2]


# -- on a cluster ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"servopt_slot": 1, "epyc-7763": 1},
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"servopt_slot": 1, "xeon-8480": 1})
    ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    assert session.is_relative_to(tempfile.gettempdir()), f"Ray writes outside the sandbox: {session}"
    nodes = {kind: next(n["NodeID"][:8] for n in ray.nodes() if n["Alive"] and kind in n["Resources"]) for kind in KINDS.values()}
    yield {"address": c.address, "nodes": nodes, "cluster": c}
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def targets_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("targets") / "targets.yaml"
    path.write_text(TARGETS)
    return path


@pytest.fixture(scope="module")
def ray_run(cluster, trained, digits, targets_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("ray") / "run"
    t0 = time.time()
    result = runner.invoke(app, [*_cmd(trained["path"], digits, out, targets_file), "--ray", cluster["address"]])
    assert result.exit_code == 0, result.output
    print(f"ray sweep: {time.time() - t0:.0f} s")
    return out


@pytest.mark.slow
def test_each_variant_is_measured_on_the_nodes_its_targets_name(ray_run, cluster):
    records = _records(ray_run)
    assert sorted((r["name"], r["measured_for"]) for r in records) == sorted((v, k) for v in VARIANTS for k in KINDS.values())
    for r in records:
        if r["status"] != "ok":
            continue
        node = r["environment"]["node"]
        assert node.endswith("/" + cluster["nodes"][r["measured_for"]]), (r["name"], r["measured_for"], node)
        assert r["phases"] and all(p["node"] == node for p in r["phases"])  # every timed phase says where it ran
    summary = json.loads((ray_run / "summary.json").read_text())
    for d in summary["targets"]:
        kind = KINDS[d["target"]["name"]]
        assert d["status"] == "pass" and d["result"]["measured_for"] == kind
        assert len(d["verdicts"]) == 2, "decided on its own kind's two measured variants only"
        assert cluster["nodes"][kind] in d["reason"]
    assert {k["kind"]: k["targets"] for k in summary["kinds"]} == {"epyc-7763": ["epyc"], "xeon-8480": ["xeon"]}
    for k in summary["kinds"]:
        assert [n.rsplit("/", 1)[1] for n in k["nodes"]] == [cluster["nodes"][k["kind"]]]
        assert k["interleaved"]["environment"]["node"].endswith(cluster["nodes"][k["kind"]])  # re-measured there too
        assert (ray_run / "profiles" / k["kind"]).is_dir()
    for t in _tasks(ray_run):  # every job of a kind ran on a node of that kind; builds anywhere
        if t.get("resources"):
            kind = measurement_kind(t["resources"])
            assert t["node"].endswith(cluster["nodes"][kind]), t
    assert "Measured for epyc-7763" in (ray_run / "report.md").read_text()


@pytest.mark.slow
def test_no_two_jobs_share_a_node_at_once(ray_run):
    """Every timed phase (the sweep's and the interleaved re-measures'), and every job as a whole (builds included),
    per node: none starts before the one before it on that node stopped. And the two nodes did work in parallel."""
    phases = [p for r in _records(ray_run) for p in r["phases"]]
    for path in ray_run.glob("interleave*.json"):
        phases += json.loads(path.read_text())["phases"]
    tasks = _tasks(ray_run)
    assert {t["what"].split()[0] for t in tasks} >= {"build", "measure", "interleave-epyc-7763", "profile"}
    for spans in ([(p["node"], p["start"], p["stop"]) for p in phases], [(t["node"], t["start"], t["stop"]) for t in tasks]):
        by_node: dict[str, list[tuple[float, float]]] = {}
        for node, start, stop in spans:
            by_node.setdefault(node, []).append((start, stop))
        assert len(by_node) == 2
        for node, times in by_node.items():
            times.sort()
            for (_, stop), (start, _) in itertools.pairwise(times):
                assert start >= stop, f"two jobs at once on {node}"
    a, b = ([(t["start"], t["stop"]) for t in tasks if t["node"] == n] for n in sorted({t["node"] for t in tasks}))
    assert any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b), "the nodes never worked at the same time"


@pytest.mark.slow
def test_same_variants_and_verdicts_as_on_one_machine(ray_run, trained, digits, targets_file, tmp_path):
    """The same sweep without --ray, with Ray made unimportable: it runs as always (one record per variant, kind None,
    the keys of a run before this feature), and gives the same statuses and verdicts as each kind of node did."""
    out = tmp_path / "local"
    code = ("import sys; sys.modules['ray'] = None; from servopt.cli import app; "
            f"app({_cmd(trained['path'], digits, out, targets_file)!r}, standalone_mode=False)")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    local, distributed = _records(out), _records(ray_run)
    assert all(r["measured_for"] is None for r in local) and not (out / "work" / "ray-tasks.jsonl").exists()
    statuses = {r["name"]: r["status"] for r in local}
    assert statuses == {"ort-fp32": "ok", "ort-offline-all": "ok", "ort-int8-static-qop-u8s8": "failed"}
    for kind in KINDS.values():
        assert {r["name"]: r["status"] for r in distributed if r["measured_for"] == kind} == statuses
    int8 = [r["error"].split(":")[0] for r in [*local, *distributed] if r["status"] == "failed"]
    assert int8 == ["verification failed"] * 3
    ours, theirs = (json.loads((d / "summary.json").read_text())["targets"] for d in (out, ray_run))
    for a, b in zip(ours, theirs, strict=True):
        assert a["target"]["name"] == b["target"]["name"] and a["status"] == b["status"]
        assert {v["variant"] for v in a["verdicts"] if v["passes"]} == {v["variant"] for v in b["verdicts"] if v["passes"]}
        # Which of two passing variants is fastest can differ between two runs on a shared machine; both pass.
        assert b["recommended"] in {v["variant"] for v in a["verdicts"] if v["passes"]}


@pytest.mark.slow
def test_kinds_settling_close_calls_at_once_each_launch_into_their_own_folder(ray_run):
    """Two jobs launched into one folder read each other's job.json: the kinds' duels (and alternating re-measures)
    run at once on a cluster, so each kind has its own (a shared `work/duel` gave a kind the other's duel)."""
    from servopt.optimize.targets import kind_slug

    duels = [t for t in _tasks(ray_run) if t["what"] == "duel"]
    for t in duels:
        (kind,) = [k for k in t["resources"] if k in KINDS.values()]
        assert (ray_run / "work" / "duel" / kind_slug(kind) / "job.json").exists()
    assert not (ray_run / "work" / "duel" / "job.json").exists()


@pytest.mark.slow
def test_resume_measures_nothing_again(ray_run, cluster, trained, digits, targets_file):
    before, tasks_before = (ray_run / "results.jsonl").read_text(), len(_tasks(ray_run))
    result = runner.invoke(app, [*_cmd(trained["path"], digits, ray_run, targets_file), "--ray", cluster["address"]])
    assert result.exit_code == 0, result.output
    assert (ray_run / "results.jsonl").read_text() == before
    assert _tasks(ray_run)[tasks_before:] == [], "no job ran again: builds, measurements, re-measures and profiles cached"


@pytest.mark.slow
def test_a_target_naming_resources_no_node_has_is_refused(cluster, trained, digits, tmp_path):
    targets = tmp_path / "t.yaml"
    targets.write_text("targets:\n  - name: arm\n    hardware: Cortex-A76\n    device: cpu\n    ray_resources: {arm-a76: 1}\n")
    result = runner.invoke(app, [*_cmd(trained["path"], digits, tmp_path / "r", targets, ["ort-fp32"]), "--ray", cluster["address"]])
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "no node of the Ray cluster declares servopt_slot=1, arm-a76=1, which the targets" in message
    assert """--resources '{"servopt_slot": 1, "arm-a76": 1}'""" in message


def _measuring(proc) -> bool:
    """Whether a job process has ONNX Runtime loaded: it is measuring, so it is past ``runjob.main``'s first lines,
    where it arms its death with its worker (``die_with_parent``). A strike before that, during Python's start-up, is
    noticed only when the job arms (it exits then): on a loaded machine that took longer than the 0.5 s the tests allow
    an orphan, and the test failed with no orphan ever measuring (issue 40). Linux's /proc, as PR_SET_PDEATHSIG is."""
    try:
        return "onnxruntime" in Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:  # gone already
        return False


def _sweep_striking(cluster, model: Path, data: Path, targets_file, out: Path, strike) -> dict:
    """Fault injection: run the sweep with ``--ray`` and call ``strike(job process)`` once, while the measurement of
    ort-offline-all for the xeon node runs (``_measuring``); the sweep must still finish. Returns what ``strike``
    returned."""
    import psutil

    victim = str(out / "work" / "ort-offline-all" / "xeon-8480" / "measure" / "job.json")
    cmd = [sys.executable, "-m", "servopt", *_cmd(model, data, out, targets_file), "--ray", cluster["address"]]
    driver = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": SRC}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    struck = None
    try:
        deadline = time.time() + 400
        while struck is None and time.time() < deadline and driver.poll() is None:
            for proc in psutil.process_iter(["cmdline"]):
                if victim in (proc.info["cmdline"] or []) and "servopt.runjob" in proc.info["cmdline"] and _measuring(proc):
                    struck = strike(proc)
                    break
            time.sleep(0.05)
        assert struck is not None, "never saw the measurement to strike"
        output, _ = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 0, output[-3000:]
    return struck


@pytest.mark.slow
def test_a_worker_killed_mid_measurement_is_retried(cluster, trained, digits, targets_file, tmp_path):
    """Fault injection: the Ray worker running one variant's measurement on the xeon node is killed (SIGKILL) while its
    job process measures. The job process dies with it (no orphan measuring beside the retry), Ray runs the task
    again, and the variant's record comes from the second attempt; everything else is measured once."""
    out = tmp_path / "killed"

    def kill_worker(proc) -> dict:
        worker = proc.parent()
        assert worker is not None and "ray" in " ".join(worker.cmdline()).lower(), worker
        worker.send_signal(signal.SIGKILL)
        struck = {"at": time.time(), "job": proc}
        assert _ends_within(proc, 0.5), "the job process outlived its killed worker (an orphan measuring)"
        return struck

    killed = _sweep_striking(cluster, trained["path"], digits, targets_file, out, kill_worker)
    records = {(r["name"], r["measured_for"]): r for r in _records(out)}
    assert len(records) == len(_records(out)) == 2 * len(VARIANTS), "one record per variant and kind"
    again = records[("ort-offline-all", "xeon-8480")]
    assert again["status"] == "ok" and min(p["start"] for p in again["phases"]) > killed["at"], "measured by the retry"
    measures = [t for t in _tasks(out) if t["what"] == "measure ort-offline-all for xeon-8480"]
    assert len(measures) == 1 and "lost" not in measures[0]


@pytest.mark.slow
def test_a_job_whose_worker_keeps_dying_is_lost_after_the_retries(cluster):
    """Bounded retries: a task whose worker dies every time (os.abort) is tried 1 + RETRIES times, then comes back as
    ``Lost`` with the reason; a job that raises is not retried and raises the same error here."""
    from servopt.optimize.executor import LOST, Lost
    from servopt.optimize.ray_executor import RETRIES, RayExecutor

    with RayExecutor(owned=False) as executor:
        with pytest.raises(Lost, match=rf"^{LOST}: WorkerCrashedError after {RETRIES + 1} attempts"):
            executor.submit(os.abort, what="abort").result(timeout=180)
        with pytest.raises(FileNotFoundError):
            executor.submit(os.stat, "/nonexistent/servopt", what="stat").result(timeout=60)


@pytest.mark.slow
def test_a_job_runs_with_the_node_s_thread_settings_not_ray_s(cluster):
    """Ray starts workers with OMP_NUM_THREADS=1 where the node sets none; a job must not inherit it (PyTorch would
    measure on one thread). The cluster's nodes were started from this process's environment."""
    from servopt.optimize.ray_executor import RayExecutor

    with RayExecutor(owned=False) as executor:
        assert executor.submit(os.getenv, "OMP_NUM_THREADS", what="env").result(timeout=60) == os.environ.get("OMP_NUM_THREADS")
        assert executor.submit(os.getenv, "SERVOPT_NODE", what="env").result(timeout=60).startswith(os.uname().nodename)


@pytest.mark.slow
def test_a_job_no_alive_node_can_run_is_given_up(cluster):
    """A job whose kind has no node left would wait for one forever in Ray: it is given up after ``lost_after_s``."""
    from servopt.optimize.executor import Lost
    from servopt.optimize.ray_executor import RayExecutor

    with RayExecutor(owned=False, lost_after_s=1.0) as executor, pytest.raises(Lost, match="no alive node of the cluster has"):
        executor.submit(os.getpid, resources={"arm-a76": 1}, what="nowhere").result(timeout=60)


@pytest.mark.slow
def test_a_node_that_dies_mid_measurement_loses_only_that_attempt(cluster, trained, digits, targets_file, tmp_path):
    """Fault injection: a second xeon node joins; the node measuring one xeon variant is removed from the cluster (its
    raylet and workers killed) mid-measurement. The variant is measured again on the other xeon node; every other
    variant keeps its one record. (Last in the module: the fixture's worker may be the node removed.)"""
    c = cluster["cluster"]
    c.add_node(num_cpus=1, resources={"servopt_slot": 1, "xeon-8480": 1})
    out = tmp_path / "node-died"

    def remove_node(proc) -> dict:
        node = proc.environ()["SERVOPT_NODE"].rsplit("/", 1)[1]
        worker = proc.parent()
        c.remove_node(next(n for n in c.list_all_nodes() if n.node_id.startswith(node)), allow_graceful=False)
        # A simulated node's removal kills its raylet, not its workers: a worker notices the death only later and may
        # finish the measurement and hand its result straight to the driver (seen in CI). A machine that dies takes
        # every process with it, so the worker goes too.
        if worker is not None and worker.is_running():
            worker.send_signal(signal.SIGKILL)
        return {"at": time.time(), "node": node}

    removed = _sweep_striking(cluster, trained["path"], digits, targets_file, out, remove_node)
    records = _records(out)
    assert sorted((r["name"], r["measured_for"]) for r in records) == sorted((v, k) for v in VARIANTS for k in KINDS.values())
    again = next(r for r in records if r["name"] == "ort-offline-all" and r["measured_for"] == "xeon-8480")
    assert again["status"] == "ok" and not again["environment"]["node"].endswith(removed["node"]), "measured elsewhere"
    assert min(p["start"] for p in again["phases"]) > removed["at"]
