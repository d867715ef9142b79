"""The benchmark protocol: one implementation, used by ``bench``, ``optimize`` and the benchmarks.

Per variant, in a fresh subprocess (``worker``): load, verify on the whole
dataset (accuracy, agreement with the reference), then single-sample latency
and batch throughput under the stopping rule, each phase watched for
interference. Cold start and peak memory come from a second fresh process
(``coldstart``), timed from outside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from servopt.bench.interference import DEFAULT_THRESHOLD, CpuMonitor
from servopt.bench.metrics import agreement, classification_accuracy
from servopt.bench.stats import latency_summary, throughput, timed_loop
from servopt.data.dataset import Dataset
from servopt.runtimes.base import Session


@dataclass
class Protocol:
    warmup: int = 10
    min_runs: int = 100
    min_seconds: float = 5.0
    max_seconds: float = 120.0
    batch_size: int = 32
    batch_min_runs: int = 20
    batch_min_seconds: float = 5.0
    sweep: list[int] = field(default_factory=list)
    cold_start: bool = True
    interference_threshold: float = DEFAULT_THRESHOLD

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Protocol:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    @classmethod
    def quick(cls) -> Protocol:
        """For tests and smoke runs: same rule, tiny minimums."""
        return cls(warmup=2, min_runs=5, min_seconds=0.05, batch_size=4, batch_min_runs=3, batch_min_seconds=0.05, max_seconds=10)


def predict_all(session: Session, data: Dataset, batch_size: int) -> np.ndarray:
    outs = [session.run(data.slice(i, i + batch_size)) for i in range(0, len(data), batch_size)]
    return np.concatenate(outs)


def verify(outputs: np.ndarray, data: Dataset, reference: np.ndarray | None, task: str) -> dict:
    result: dict = {"accuracy": None, "agreement": None}
    if task == "classification" and data.labels is not None:
        result["accuracy"] = classification_accuracy(outputs, data.labels)
    if reference is not None:
        result["agreement"] = agreement(outputs, reference, task)
    return result


def measure_latency(session: Session, data: Dataset, proto: Protocol) -> dict:
    """Single-sample latency and throughput: inputs prepared before timing, round-robin over samples."""
    prepared = [session.prepare(data.slice(i, i + 1)) for i in range(min(len(data), 32))]
    with CpuMonitor(proto.interference_threshold) as mon:
        loop = timed_loop(
            session.run_prepared, prepared, min_runs=proto.min_runs, min_seconds=proto.min_seconds,
            max_seconds=proto.max_seconds, warmup=proto.warmup,
        )
    step = max(1, len(loop.times_ns) // 400)  # a few hundred raw samples for distribution plots
    return {"latency": latency_summary(loop.times_ns), "throughput": throughput(loop.times_ns, 1),
            "stopped_by": loop.stopped_by, "interference": mon.report,
            "samples_ms": [round(t / 1e6, 4) for t in loop.times_ns[::step]]}


def measure_batch(session: Session, data: Dataset, proto: Protocol, batch_size: int) -> dict:
    prepared = [session.prepare(data.batch(batch_size, offset=o * batch_size)) for o in range(2)]
    with CpuMonitor(proto.interference_threshold) as mon:
        loop = timed_loop(
            session.run_prepared, prepared, min_runs=proto.batch_min_runs, min_seconds=proto.batch_min_seconds,
            max_seconds=proto.max_seconds, warmup=max(1, proto.warmup // 5),
        )
    return {"throughput": throughput(loop.times_ns, batch_size), "latency": latency_summary(loop.times_ns),
            "stopped_by": loop.stopped_by, "interference": mon.report}


def check_gate(result: dict, gate: dict | None) -> str | None:
    """Why a variant fails verification (too far from the original to be worth timing), or None."""
    if not gate:
        return None
    agr, acc = result.get("agreement") or {}, result.get("accuracy")
    if "top1_agreement" in agr and agr["top1_agreement"] < gate.get("min_agreement", 0.0):
        return f"top-1 agreement with the original {agr['top1_agreement']:.1%} < {gate['min_agreement']:.0%}"
    if acc and gate.get("reference_top1") is not None:
        drop = (gate["reference_top1"] - acc["top1"]) * 100
        if drop > gate.get("max_drop_points", 100):
            return f"accuracy drop {drop:.2f} points > {gate['max_drop_points']} allowed"
    if "cosine_min" in agr and agr["cosine_min"] < gate.get("min_cosine", -1.0):
        return f"cosine similarity to the original {agr['cosine_min']:.4f} < {gate['min_cosine']}"
    return None


def measure_session(session: Session, data: Dataset, reference: np.ndarray | None, task: str, proto: Protocol,
                    outputs_path: Path | None = None, gate: dict | None = None) -> dict:
    """Everything measured inside the worker process (see module doc): verified first, then timed."""
    outputs = predict_all(session, data, max(1, proto.batch_size))
    if outputs_path is not None:
        np.save(outputs_path, outputs)
    result = verify(outputs, data, reference, task)
    failed = check_gate(result, gate)
    if failed:
        return {**result, "status": "failed", "error": f"verification failed: {failed}"}
    single = measure_latency(session, data, proto)
    batch = measure_batch(session, data, proto, proto.batch_size)
    sweep = {str(bs): measure_batch(session, data, proto, bs)["throughput"] for bs in proto.sweep}
    result.update(
        latency_ms=single["latency"],
        throughput_ips={"single": single["throughput"], "batch": batch["throughput"], "sweep": sweep or None},
        batch_latency_ms=batch["latency"],
        latency_samples_ms=single["samples_ms"],
        interference={
            "single": single["interference"],
            "batch": batch["interference"],
            "flagged": single["interference"]["flagged"] or batch["interference"]["flagged"],
        },
        stopped_by={"single": single["stopped_by"], "batch": batch["stopped_by"]},
    )
    return result


def python_env(extra_env: dict | None) -> dict:
    """The environment for a servopt subprocess: this one's, servopt importable, plus ``extra_env``."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra_env or {})
    return env


def run_worker(job: dict, workdir: Path, timeout_s: float = 1800) -> dict:
    """Measure one variant in a fresh subprocess; a crash becomes a failed result, not an exception."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path = workdir / "job.json"
    out_path = workdir / "measure.json"
    out_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "servopt.bench.worker", str(job_path), str(out_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=python_env(job.get("env")))
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {timeout_s:.0f} s"}
    (workdir / "worker.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"status": "failed", "error": f"worker exited {proc.returncode}: " + " | ".join(tail)}
    return json.loads(out_path.read_text())


def run_cold_start(job: dict, timeout_s: float = 900) -> dict:
    """A fresh process loads the model and answers one request; timed from outside, spawn to answer."""
    cmd = [sys.executable, "-m", "servopt.bench.coldstart", json.dumps(job)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(job.get("env")))
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        elapsed = time.perf_counter() - start
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"error": "cold start timed out"}
    if not line.startswith("{"):
        return {"error": "cold start failed: " + " | ".join(err.strip().splitlines()[-2:])}
    inside = json.loads(line)
    return {"total_s": elapsed, **inside}
