"""A projection that knows what a vCPU is, and a band that holds what varies (issue 42): the host's topology, the
instance as cores × threads, the law per physical core with SMT measured or assumed, the held-out 1 → 2 check, the
served capacity's spread and the CPU change in the band, and the share an unserved variant is judged at. Every
machine fact is injected (topologies, CPU features, curves): the answers do not depend on the CPU running the tests."""

from __future__ import annotations

from pathlib import Path

from servopt.contracts import Topology
from servopt.machine import read_topology


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
