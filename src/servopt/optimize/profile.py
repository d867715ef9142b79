"""Where the time goes, op by op: the CPU counterpart of the tutorial's Nsight timeline.

ONNX Runtime's own profiler, OpenVINO's performance counters, or torch.profiler,
aggregated by operator type: top operators by time and their share.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path

from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.optimize.rundir import artifact_of


def _top(times: dict[str, float], calls: dict[str, int], runs: int, top: int) -> dict:
    total = sum(times.values()) or 1.0
    ops = sorted(times.items(), key=lambda kv: -kv[1])
    return {
        "total_ms_per_run": total / runs / 1000,
        "ops": [{"op": op, "ms_per_run": t / runs / 1000, "share": t / total, "calls_per_run": calls[op] / runs}
                for op, t in ops[:top]],
    }


def profile_onnxruntime(path: str, options: dict, data: Dataset, runs: int, top: int) -> dict:
    from servopt.runtimes.onnxruntime_runtime import OrtSession

    with tempfile.TemporaryDirectory() as tmp:
        sess = OrtSession(path, {**options, "enable_profiling": True, "profile_file_prefix": str(Path(tmp) / "ort")})
        feeds = [data.slice(i, i + 1) for i in range(min(runs, len(data)))]
        for i in range(runs):
            sess.run_prepared(feeds[i % len(feeds)])
        events = json.loads(Path(sess.end_profiling()).read_text())
    times: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for ev in events:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            op = ev.get("args", {}).get("op_name", "?")
            times[op] += ev.get("dur", 0)
            calls[op] += 1
    return {"profiler": "onnxruntime", **_top(times, calls, runs, top)}


def profile_openvino(path: str, options: dict, data: Dataset, runs: int, top: int) -> dict:
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(path), "CPU", {"PERF_COUNT": True, "PERFORMANCE_HINT": options.get("hint", "LATENCY")})
    request = compiled.create_infer_request()
    times: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for i in range(runs):
        request.infer(data.slice(i % len(data), i % len(data) + 1))
        for info in request.get_profiling_info():
            if info.status == info.Status.EXECUTED:
                times[info.node_type] += info.real_time.total_seconds() * 1e6
                calls[info.node_type] += 1
    return {"profiler": "openvino", **_top(times, calls, runs, top)}


def profile_torch(ref: dict, options: dict, data: Dataset, runs: int, top: int) -> dict:
    import torch

    from servopt.runtimes.torch_runtime import TorchSession

    sess = TorchSession({"format": "torch", "ref": ref}, options)
    feeds = [sess.prepare(data.slice(i, i + 1)) for i in range(min(runs, len(data)))]
    sess.run_prepared(feeds[0])
    times: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(runs):
            sess.run_prepared(feeds[i % len(feeds)])
    for ev in prof.key_averages():
        if ev.key.startswith("aten::") or ev.key.startswith("mkldnn"):
            times[ev.key] += ev.self_cpu_time_total
            calls[ev.key] += ev.count
    return {"profiler": "torch.profiler", **_top(times, calls, runs, top)}


def profile_record(record: dict, run_dir: Path, runs: int = 30, top: int = 12) -> dict:
    """Profile one measured variant of a run directory on its evaluation inputs."""
    data = Dataset.load(run_dir / "data" / "eval.npz")
    options = record.get("options") or {}
    if record.get("status") != "ok":
        raise UserError(f"variant {record['name']} did not run ({record.get('error')})", fix="profile a variant that ran")
    if record["runtime"] == "onnxruntime":
        return profile_onnxruntime(record["artifact"], options, data, runs, top)
    if record["runtime"] == "openvino":
        return profile_openvino(record["artifact"], options, data, runs, top)
    if record.get("artifact_format") == "torch":
        return profile_torch(artifact_of(record, run_dir)["ref"], options, data, runs, top)
    raise UserError(f"no profiler for runtime {record['runtime']}", fix="profile an ONNX Runtime, OpenVINO or torch variant")
