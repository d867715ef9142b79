"""Subprocess entry: measure one variant and write its figures.

``python -m servopt.bench.worker job.json result.json``. Running each variant
in its own process means one variant's allocator state, thread pools or
compiled kernels cannot disturb the next (optimum-benchmark, Model Navigator).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from servopt.bench.environment import environment
from servopt.bench.protocol import Protocol, measure_session
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.results import write_json_atomic
from servopt.runtimes.base import open_session


def main(job_path: str, out_path: str) -> None:
    try:
        measure(job_path, out_path)
    except UserError as e:  # a clean, explained failure: recorded, and the sweep goes on
        write_json_atomic(Path(out_path), {"status": "failed", "error": e.problem})


def measure(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    data = Dataset.load(Path(job["data"]))
    reference = np.load(job["reference"]) if job.get("reference") else None
    start = time.perf_counter()
    session = open_session(job["artifact"], job["runtime"], job.get("options"))
    load_s = time.perf_counter() - start
    compile_s = session.warm_compile(data.slice(0, 1)) if hasattr(session, "warm_compile") and job.get("options", {}).get("compile") else 0.0
    outputs_path = Path(job["save_outputs"]) if job.get("save_outputs") else None
    result = measure_session(session, data, reference, job.get("task", "classification"), Protocol.from_dict(job["protocol"]),
                             outputs_path, job.get("gate"))
    result.setdefault("status", "ok")
    result.update(load_s=load_s, compile_s=compile_s, environment=environment(session.info()))
    write_json_atomic(Path(out_path), result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
