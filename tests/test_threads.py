"""Every runtime keeps to the threads it is given (issue 41), and servopt sizes its work by the cores it may use, not
the host's (issue 42).

Two single-thread instances must compute on two cores. Their throughput cannot be asserted on a shared machine, so
these tests assert on what the runtimes *do*: how many threads burn CPU while the instances run, which cores those
threads may run on (a runtime that pins narrows the mask), and how much of a core each burns. The 1 → 2 instance
throughput, same run and interleaved, is ``benchmarks/instance_scaling.py``'s (docs/hardware.md).
"""

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

from servopt.bench.cputime import busy_threads, thread_cores, threads_cpu_s
from servopt.bench.jobs import OpenSpec
from servopt.bench.launcher import launch
from servopt.bench.scaling import InstancesJob, InstancesProbe, open_as_served
from servopt.contracts import Artifact
from servopt.data.dataset import Dataset
from servopt.envs import list_envs
from servopt.machine import Device, usable_cores
from servopt.models.sources import load_model
from servopt.runtimes import RUNTIMES, get_runtime

LINUX = pytest.mark.skipif(not Path("/proc/self/task").exists() or not hasattr(os, "sched_getaffinity"),
                           reason="Linux /proc and affinity masks only")
TWO_CORES = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or usable_cores() < 2,
                               reason="two instances on two cores need two usable cores")
CPU_RUNTIMES = [n for n in RUNTIMES.names() if RUNTIMES.classes[n].device is Device.CPU]
BATCH = 8
# The others' share of the machine past which "two instances burned more than one core" is not judged: another process
# on one of two cores leaves the instances about 1.3 cores, two leave them one.
QUIET = 0.25


def small_cnn():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(64, 10)).eval()


@pytest.fixture(scope="module")
def cnn_files(tmp_path_factory) -> dict[str, Path]:
    """A small conv net (a few ms a batch of 8 at 32x32 on one core: long enough that the runtime, not Python, holds
    the core) as ONNX and as a torch.export program."""
    import torch

    folder = tmp_path_factory.mktemp("threads")
    net, x = small_cnn(), torch.zeros(BATCH, 3, 32, 32)
    torch.onnx.export(net, (x,), str(folder / "cnn.onnx"), dynamo=False, input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17)
    torch.export.save(torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},)), str(folder / "cnn.pt2"))
    return {"onnx": folder / "cnn.onnx", "torch": folder / "cnn.pt2"}


def spec_for(name: str, files: dict[str, Path]) -> OpenSpec:
    rt = get_runtime(name)
    if "onnx" in rt.artifact_formats:
        return OpenSpec(name=name, artifact=Artifact(format="onnx", path=str(files["onnx"])), runtime=name)
    return OpenSpec(name=name, artifact=Artifact(format="torch", ref=load_model(files["torch"]).ref()), runtime=name)


def runnable_here(name: str) -> None:
    ok, why = get_runtime(name).available()
    if not ok:
        pytest.skip(f"{name} is not available here: {why}")


def probe(name: str, files: dict[str, Path], tmp: Path, seconds: float) -> InstancesProbe:
    """Two one-thread instances of ``name`` and an every-core session opened after them, run together: in this process,
    or, for a runtime with an environment of its own, in a fresh process there (only where that environment exists:
    creating one takes a minute and 500 MB, ``test_runtime_envs``'s slow test does it)."""
    runnable_here(name)
    rng = np.random.default_rng(0)
    Dataset({"input": rng.standard_normal((BATCH, 3, 32, 32)).astype(np.float32)}, None, None, "t").save(tmp / "d.npz")
    job = InstancesJob(session=spec_for(name, files), data=str(tmp / "d.npz"), batch_size=BATCH, seconds=seconds, counts=[2])
    own = get_runtime(name).environment()
    if own is None:
        return job.run(0.0)
    if not any(e.state == "ready" and name in e.used_by for e in list_envs({name: own})):
        pytest.skip(f"{name} runs in its own Python environment, not created on this machine (test_runtime_envs makes it)")
    launched = launch(job, tmp / "job")
    assert launched.result is not None, launched.failure
    return launched.result


@LINUX
@TWO_CORES
@pytest.mark.parametrize("name", CPU_RUNTIMES)
def test_two_single_thread_instances_compute_on_two_cores(name, cnn_files, tmp_path):
    """The scaling measurement's and the server's layout: two one-thread instances, and a session with every core
    opened after them (the scaling job's N-thread session, the server's solo session), in one process. While the two
    instances run: two threads burn CPU, one per instance, each the instance's own calling thread (no runtime adds
    helpers to a one-thread session, nor takes the count of the session opened last: torch did, four threads on two
    cores); they are not confined to one and the same core (OpenVINO, and its ONNX Runtime EP, pinned both to core 0);
    and together they burn more than one core, unless other processes took the machine meanwhile."""
    result = probe(name, cnn_files, tmp_path, seconds=0.8)
    run = result.runs[0]
    what = (f"{name}: callers {run.caller_cpu_s}, threads {run.threads_cpu_s} CPU s over {run.window_s:.2f} s, "
            f"cores {run.caller_cores}, others {run.other_share:.0%}")
    assert run.busy_threads() == 2, f"one busy thread per one-thread instance: {what}"
    assert sum(run.caller_cpu_s) >= 0.9 * sum(run.threads_cpu_s), f"each instance computes on its calling thread: {what}"
    assert all(c is not None for c in run.caller_cores) and not run.shared_core(), f"confined to one core: {what}"
    if run.other_share < QUIET:  # on a quiet machine two cores' worth is the physics; one core is all pinning leaves
        assert run.cores_busy > 1.2, f"two instances burned {run.cores_busy:.2f} cores: {what}"
    assert result.threads == [1, 1] and result.pinned in ([None, None], [False, False]), (result.threads, result.pinned)


def test_openvino_pins_only_a_session_that_takes_every_core(monkeypatch):
    """OpenVINO pins each compiled model's threads to the first cores: a session of fewer threads than the cores this
    process may use is left to the OS; one that takes them all, or a pinning asked for, is pinned."""
    from servopt.runtimes import base
    from servopt.runtimes.openvino_runtime import OpenVinoOptions, compile_config

    monkeypatch.setattr(base, "usable_cores", lambda: 4)
    assert compile_config(OpenVinoOptions(threads=1))["ENABLE_CPU_PINNING"] is False
    assert compile_config(OpenVinoOptions(threads=3))["ENABLE_CPU_PINNING"] is False
    assert compile_config(OpenVinoOptions(threads=4))["ENABLE_CPU_PINNING"] is True
    assert compile_config(OpenVinoOptions())["ENABLE_CPU_PINNING"] is True  # its default: every core
    assert compile_config(OpenVinoOptions(threads=1, cpu_pinning=True))["ENABLE_CPU_PINNING"] is True
    assert compile_config(OpenVinoOptions(cpu_pinning=False))["ENABLE_CPU_PINNING"] is False


def test_openvino_reads_back_its_pinning(cnn_files):
    runnable_here("openvino")
    spec = spec_for("openvino", cnn_files)
    one = open_as_served(spec, 1).info()
    assert one.threads == 1 and one.details["cpu_pinning"] is (usable_cores() <= 1)


def test_a_torch_session_keeps_its_threads_when_another_is_opened_after_it(cnn_files):
    """``torch.set_num_threads`` is the whole process's; each torch session sets its own count in the thread that
    calls it, so a two-thread session opened after a one-thread one changes neither."""
    import torch

    runnable_here("torch")
    spec = spec_for("torch", cnn_files)
    one = open_as_served(spec, 1)
    two = open_as_served(spec, 2)
    seen = []
    feed = {"input": np.zeros((1, 3, 32, 32), np.float32)}

    def call(session) -> None:
        session.run(feed)
        seen.append(torch.get_num_threads())

    for session in (one, two, one):
        t = threading.Thread(target=call, args=(session,))
        t.start()
        t.join()
    assert seen == [1, 2, 1]
    assert (one.info().threads, two.info().threads) == (1, 2)


# --- the cores servopt may use (issue 42) ---

def test_usable_cores_is_the_affinity_mask_not_the_host(monkeypatch):
    from servopt import machine

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 4}, raising=False)
    assert machine.usable_cores() == 2


def test_the_server_splits_the_cores_it_may_use(monkeypatch, tmp_path):
    """A throughput target on a host of 64 CPUs of which the server may use 2 (a container's cpuset): two one-thread
    instances, not two of 32 threads each."""
    from conftest import channel_mean_onnx
    from servopt.serve.model import from_file

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 6}, raising=False)
    model = from_file(channel_mean_onnx(tmp_path / "m.onnx"), "m")
    model.objective = "throughput"
    model.apply_instances(None, None)
    assert model.instances == 2 and model.options["intra_op_threads"] == 1


@LINUX
@TWO_CORES
def test_under_a_cpuset_of_one_core_the_server_runs_one_instance(tmp_path):
    """The same, for real: a process whose affinity mask holds one core (``taskset``) lays out one instance."""
    from conftest import channel_mean_onnx

    path = channel_mean_onnx(tmp_path / "m.onnx")
    code = ("import json, os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "from servopt.serve.model import from_file\n"
            "m = from_file(__import__('pathlib').Path(sys.argv[1]), 'm'); m.objective = 'throughput'\n"
            "m.apply_instances(None, None); print(json.dumps([m.instances, m.options, m.solo_options]))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [1, {}, None]


# --- servopt serve --instances 2 --threads 1 ---

@LINUX
@TWO_CORES
@pytest.mark.slow
@pytest.mark.parametrize("name", ["onnxruntime", "openvino"])
def test_serve_two_instances_of_one_thread_run_two_compute_threads(name, cnn_files):
    """``servopt serve --instances 2 --threads 1`` under load: the server process's threads that burn CPU are its event
    loop and its two inference threads, nothing else (a runtime's pool, a solo session), and the two are not confined
    to one and the same core."""
    import httpx

    from servopt.serve.batcher import INFERENCE_THREAD_PREFIX
    from servopt.serve.harness import ServerProcess

    runnable_here(name)
    body = {"inputs": [{"name": "input", "shape": [BATCH, 3, 32, 32], "datatype": "FP32",
                        "data": np.random.default_rng(0).standard_normal(BATCH * 3 * 32 * 32).round(3).tolist()}]}
    raw = json.dumps(body).encode()
    with ServerProcess(cnn_files["onnx"], "--instances", "2", "--threads", "1", "--runtime", name, "--max-batch", str(BATCH),
                       "--name", "cnn") as server:
        pid, url = server.proc.pid, f"{server.url}/v2/models/cnn/infer"
        stop = time.perf_counter() + 2.5

        def client() -> None:
            with httpx.Client(timeout=30) as http:
                while time.perf_counter() < stop:
                    assert http.post(url, content=raw, headers={"content-type": "application/json"}).status_code == 200

        clients = [threading.Thread(target=client) for _ in range(4)]
        for c in clients:
            c.start()
        time.sleep(0.8)
        names = {int(t.name): (t / "comm").read_text().strip() for t in Path(f"/proc/{pid}/task").iterdir()}
        before, t0 = threads_cpu_s(pid), time.perf_counter()
        time.sleep(0.5)
        masks = {tid: thread_cores(tid) for tid, comm in names.items() if comm.startswith(INFERENCE_THREAD_PREFIX)}
        time.sleep(0.5)
        after, window = threads_cpu_s(pid), time.perf_counter() - t0
        for c in clients:
            c.join()
    busy = busy_threads(before, after, window, share=0.05)
    compute = {names.get(tid, "?") for tid in busy if tid != pid}
    assert len(compute) == 2 and all(n.startswith(INFERENCE_THREAD_PREFIX) for n in compute), (compute, busy, names)
    cores = [m for tid, m in masks.items() if tid in busy]
    assert len(cores) == 2 and not (len(cores[0]) == 1 and cores[0] == cores[1]), cores
