"""A projection that knows what a vCPU is, and a band that holds what varies (issue 42): the host's topology, the
instance as cores × threads, the law per physical core with SMT measured or assumed, the held-out 1 → 2 check, the
served capacity's spread and the CPU change in the band, and the share an unserved variant is judged at. Every
machine fact is injected (topologies, CPU features, curves): the answers do not depend on the CPU running the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from servopt.contracts import Topology
from servopt.machine import read_topology
from servopt.optimize.targets import PRESETS, Target, load_targets


# ---------------------------------------------------------------------------------------------------- the host's topology
def _sysfs(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    return root


def test_topology_is_read_from_the_sibling_lists_of_the_cpus_this_process_may_use(tmp_path):
    root = _sysfs(tmp_path, {0: "0,2", 1: "1-1,3", 2: "0,2", 3: "1,3"})  # 2 cores × 2 threads, lscpu's "2 per core"
    assert read_topology({0, 1, 2, 3}, root) == Topology(cpus=4, cores=2, threads_per_core=2, siblings=[[0, 2], [1, 3]])
    mine = read_topology({0, 1}, root)  # a cpuset of one thread per core: no sibling of each other here
    assert (mine.cores, mine.threads_per_core) == (2, 1)
    lonely = read_topology({0, 1}, tmp_path / "nothing")
    assert lonely.source == "unknown" and (lonely.cores, lonely.threads_per_core) == (2, 1)


def test_every_measurement_records_its_topology():
    from servopt.machine import environment

    topo = environment().topology
    assert topo is not None and topo.cpus >= 1 and topo.cores * topo.threads_per_core >= topo.cpus


# ---------------------------------------------------------------------------------------------------- the target's instance
def test_a_target_instance_is_cores_times_threads_with_the_cloud_default():
    assert (PRESETS["cpu-server"].instance_cores, PRESETS["cpu-server"].instance_threads) == (4, 2)
    base = {"name": "t", "hardware": "x", "device": "cpu"}
    assert Target(**base, instance_vcpus=16).instance_threads == 2  # AWS's ThreadsPerCore default
    assert "set threads_per_core" in Target(**base, instance_vcpus=16).layout_words
    assert Target(**base, instance_vcpus=3).instance_cores == 3  # an odd count cannot be 2 threads a core
    graviton = Target(**base, instance_vcpus=8, threads_per_core=1)
    assert graviton.instance_cores == 8 and "(stated)" in graviton.layout_words


def test_a_vcpu_count_that_is_no_whole_number_of_cores_is_refused(tmp_path):
    from servopt.errors import UserError

    f = tmp_path / "t.yaml"
    f.write_text("targets:\n  - preset: cpu-server\n    name: odd\n    instance_vcpus: 7\n")
    with pytest.raises(UserError, match="instance_vcpus 7 is not a whole number of cores of 2 threads"):
        load_targets(str(f))
