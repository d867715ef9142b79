"""The entry point of every job process: ``python -m servopt.runjob job.json out.json``.

It sits above every layer so it can know every kind of job: measurement jobs (``bench.jobs``) and builds
(``passes.build_job``). It writes the typed result, or ``{"job_error": …}`` for a clean, explained failure (the
launcher records it and the sweep goes on); anything else is a crash the launcher reports with the log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def die_with_parent(parent: int) -> None:
    """Linux: end this process when ``parent`` (the process that launched it) dies. A distributed sweep sets
    ``SERVOPT_DIE_WITH_PARENT`` to its Ray worker's pid: a worker killed mid-job must not leave its measurement running
    on the node while the job is retried (an orphan would share the machine with the next measurement, and write into
    its folder)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def main(job_path: str, out_path: str) -> None:
    started = time.perf_counter()
    parent = os.environ.pop("SERVOPT_DIE_WITH_PARENT", "")  # for this process only, not for what it starts
    if parent.isdigit():
        die_with_parent(int(parent))
    from servopt.bench import scaling  # noqa: F401  (registers the scaling and instances jobs)
    from servopt.bench.jobs import JOB_KINDS
    from servopt.errors import UserError
    from servopt.passes import build_job  # noqa: F401  (registers the build job)
    from servopt.peers import jobs  # noqa: F401  (registers a peer's build job)
    from servopt.results import write_json_atomic

    raw = json.loads(Path(job_path).read_text())
    job = JOB_KINDS[raw["kind"]].model_validate(raw)
    try:
        result = job.run(started)
    except UserError as e:
        write_json_atomic(Path(out_path), {"job_error": e.problem})
        return
    write_json_atomic(Path(out_path), result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
