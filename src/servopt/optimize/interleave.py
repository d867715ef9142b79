"""Re-measure close candidates side by side: A B C ref, A B C ref, … in one process.

The machine is shared: two runs of the same variant minutes apart can differ by
2×. Measuring candidates and the reference (ONNX Runtime defaults) in rounds
within one process makes every ratio a same-run ratio; the median over rounds
of the per-round ratio is what the report shows.

``python -m servopt.optimize.interleave job.json out.json``
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from servopt.bench.environment import environment
from servopt.bench.protocol import Protocol, measure_batch, measure_latency, python_env
from servopt.data.dataset import Dataset
from servopt.results import write_json_atomic
from servopt.runtimes.base import open_session


def measure_side_by_side(sessions: list[dict], reference: str, data_path: Path, proto: Protocol, rounds: int,
                         workdir: Path, env: dict | None = None) -> dict:
    """Run ``sessions`` (see ``rundir.session_of``; ``reference`` among them) interleaved in a fresh process.
    Returns the figures, or ``{"error": …}`` when the process failed."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path = workdir / "interleave-job.json", workdir / "interleave-out.json"
    out_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps({"variants": sessions, "reference": reference, "data": str(data_path),
                                    "protocol": proto.to_dict(), "rounds": rounds}))
    proc = subprocess.run([sys.executable, "-m", "servopt.optimize.interleave", str(job_path), str(out_path)],
                          capture_output=True, text=True, env=python_env(env), timeout=1800)
    if proc.returncode != 0 or not out_path.exists():
        (workdir / "interleave.log").write_text(proc.stdout + proc.stderr)
        return {"error": "interleaved re-measure failed: " + " | ".join(proc.stderr.strip().splitlines()[-2:])}
    return json.loads(out_path.read_text())


def main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    data = Dataset.load(Path(job["data"]))
    proto = Protocol.from_dict(job["protocol"])
    sessions = {}
    for v in job["variants"]:
        s = open_session(v["artifact"], v["runtime"], v.get("options"))
        if v.get("options", {}).get("compile"):
            s.warm_compile(data.slice(0, 1))
        sessions[v["name"]] = s
    ref = job["reference"]
    rounds: list[dict] = []
    for _ in range(job.get("rounds", 3)):
        this = {}
        for name, s in sessions.items():
            single = measure_latency(s, data, proto)
            batch = measure_batch(s, data, proto, proto.batch_size)
            this[name] = {"p50_ms": single["latency"]["p50"], "throughput_ips": batch["throughput"],
                          "flagged": single["interference"]["flagged"] or batch["interference"]["flagged"]}
        rounds.append(this)
    summary = {}
    for name in sessions:
        p50s = [r[name]["p50_ms"] for r in rounds]
        tps = [r[name]["throughput_ips"] for r in rounds]
        summary[name] = {
            "p50_ms": statistics.median(p50s),
            "throughput_ips": statistics.median(tps),
            "p50_ms_rounds": p50s,
            "throughput_rounds": tps,
            "p50_ratio_vs_reference": statistics.median(r[name]["p50_ms"] / r[ref]["p50_ms"] for r in rounds),
            "throughput_ratio_vs_reference": statistics.median(r[name]["throughput_ips"] / r[ref]["throughput_ips"] for r in rounds),
            "flagged_rounds": sum(r[name]["flagged"] for r in rounds),
        }
    write_json_atomic(Path(out_path), {"reference": ref, "rounds": len(rounds), "order": list(sessions), "variants": summary,
                                       "protocol": proto.to_dict(), "environment": environment()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
