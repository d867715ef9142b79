"""servopt sizes its work by the cores it may use, not the host's (issue 42)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servopt.machine import usable_cores

LINUX = pytest.mark.skipif(not Path("/proc/self/task").exists() or not hasattr(os, "sched_getaffinity"),
                           reason="Linux /proc and affinity masks only")
TWO_CORES = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or usable_cores() < 2,
                               reason="two instances on two cores need two usable cores")


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
