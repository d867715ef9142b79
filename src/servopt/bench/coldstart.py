"""Subprocess entry for cold start: import, load, answer one request, report peak memory.

Prints one JSON line as soon as the first answer exists (the parent stops its
clock on that line), so interpreter start and imports count, as they do when a
serving container starts.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def peak_rss_kb() -> int:
    """This process's peak resident memory. ``ru_maxrss`` is not used: Linux carries it over
    fork+exec, so a child would report its parent's peak; ``VmHWM`` belongs to this address space."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main(job_json: str) -> None:
    t0 = time.perf_counter()
    job = json.loads(job_json)
    import numpy as np

    from servopt.runtimes.base import open_session
    from servopt.spec import ModelSpec

    spec = ModelSpec.from_dict(job["spec"])
    feed = {}
    for t in spec.inputs:
        shape = t.concrete_shape(1, {k: 16 for k in ("sequence", "seq", "sequence_length")})
        feed[t.name] = np.zeros(shape, dtype=t.dtype)
    t1 = time.perf_counter()
    session = open_session(job["artifact"], job["runtime"], job.get("options"))
    t2 = time.perf_counter()
    session.run(feed)
    t3 = time.perf_counter()
    peak_kb = peak_rss_kb()
    line = {"imports_s": t1 - t0, "load_s": t2 - t1, "first_inference_s": t3 - t2, "peak_rss_mb": peak_kb / 1024}
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
