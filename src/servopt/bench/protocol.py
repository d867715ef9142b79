"""The benchmark protocol: one implementation, used by ``bench``, ``optimize`` and the benchmarks.

Per variant, in a fresh subprocess (a ``MeasureJob``, see ``jobs``): load,
verify on the whole dataset (the model family's judgement against labels and
against the original), then single-sample latency and batch throughput under
the stopping rule, each phase watched for interference and stamped with its
wall-clock start and stop. Cold start and peak memory come from a second fresh
process (a ``ColdStartJob``), timed from outside.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from servopt.bench.interference import DEFAULT_THRESHOLD, CpuMonitor
from servopt.bench.stats import latency_summary, throughput, timed_loop
from servopt.contracts import (
    CpuReport,
    Gate,
    GridPoint,
    Interference,
    Latency,
    LengthBatching,
    Measured,
    Phase,
    SessionInfo,
    Throughput,
)
from servopt.data.dataset import Dataset
from servopt.families.base import Family
from servopt.machine import node_name
from servopt.runtimes.base import Session


class Protocol(BaseModel):
    """The stopping rule and phases of one measurement (identical for every variant of a run)."""

    model_config = ConfigDict(extra="forbid")

    warmup: int = 10
    min_runs: int = 100
    min_seconds: float = 5.0
    max_seconds: float = 120.0
    batch_size: int = 32
    batch_min_runs: int = 20
    batch_min_seconds: float = 5.0
    sweep: list[int] = Field(default_factory=list)
    grid: list[tuple[int, int]] = Field(default_factory=list)  # (batch, sequence length) points for text encoders
    length_batching: bool = False  # text encoders: real texts first-come vs sorted by length
    cold_start: bool = True
    interference_threshold: float = DEFAULT_THRESHOLD
    axes_only: bool = False  # only the family's own axes (grid, length batching) of a variant already verified and timed

    @classmethod
    def quick(cls) -> Protocol:
        """For tests and smoke runs: same rule, tiny minimums."""
        return cls(warmup=2, min_runs=5, min_seconds=0.05, batch_size=4, batch_min_runs=3, batch_min_seconds=0.05, max_seconds=10)


class PhaseResult(BaseModel):
    latency: Latency
    throughput: float
    stopped_by: str
    interference: CpuReport
    phase: Phase
    samples_ms: list[float] = Field(default_factory=list)


def predict_all(session: Session, data: Dataset, batch_size: int) -> np.ndarray:
    """Outputs for every sample, in the data's order. Inputs of varying length run in batches of similar lengths, as a
    server batches them (``serve.batcher`` groups a collected batch by length): arrival-order batches padded the text
    demo's 453 texts to 3.4× the tokens of sorted ones, most of a text variant's verification time. Whether a sample's
    output depends on its batch companions is checked apart (``batch_consistency``), on an arrival-order batch."""
    if data.lengths is None:
        return np.concatenate([session.run(data.slice(i, i + batch_size)) for i in range(0, len(data), batch_size)])
    order = np.argsort(data.lengths, kind="stable")
    sorted_out = np.concatenate([session.run(data.rows(order[i:i + batch_size])) for i in range(0, len(data), batch_size)])
    out = np.empty_like(sorted_out)
    out[order] = sorted_out
    return out


def _phase(name: str, call, prepared: list, proto: Protocol, min_runs: int, min_seconds: float, warmup: int,
           samples_per_call: int) -> PhaseResult:
    start = time.time()
    with CpuMonitor(proto.interference_threshold) as mon:
        loop = timed_loop(call, prepared, min_runs=min_runs, min_seconds=min_seconds, max_seconds=proto.max_seconds, warmup=warmup)
    step = max(1, len(loop.times_ns) // 400)  # a few hundred raw samples for distribution plots
    return PhaseResult(latency=Latency(**latency_summary(loop.times_ns)), throughput=throughput(loop.times_ns, samples_per_call),
                       stopped_by=loop.stopped_by, interference=mon.report, phase=Phase(name=name, start=start, stop=time.time(), node=node_name()),
                       samples_ms=[round(t / 1e6, 4) for t in loop.times_ns[::step]])


def measure_latency(session: Session, data: Dataset, proto: Protocol, name: str = "single") -> PhaseResult:
    """Single-sample latency and throughput: inputs prepared before timing, round-robin over samples."""
    prepared = [session.prepare(data.slice(i, i + 1)) for i in range(min(len(data), 32))]
    return _phase(name, session.run_prepared, prepared, proto, proto.min_runs, proto.min_seconds, proto.warmup, 1)


def measure_batch(session: Session, data: Dataset, proto: Protocol, batch_size: int, name: str = "batch") -> PhaseResult:
    prepared = [session.prepare(data.batch(batch_size, offset=o * batch_size)) for o in range(2)]
    return _phase(name, session.run_prepared, prepared, proto, proto.batch_min_runs, proto.batch_min_seconds,
                  max(1, proto.warmup // 5), batch_size)


def measure_session(session: Session, data: Dataset, reference: np.ndarray | None, family: Family, proto: Protocol,
                    outputs_path: Path | None = None, gate: Gate | None = None) -> Measured:
    """Everything measured inside the worker process (see module doc): verified first, then timed. With
    ``proto.axes_only``, only the family's own axes of a variant already verified and timed (a racing sweep's pick)."""
    if proto.axes_only:
        grid, batching, phases = measure_text_axes(session, data, family, proto)
        return Measured(grid=grid, length_batching=batching, phases=phases)
    outputs = predict_all(session, data, max(1, proto.batch_size))
    if outputs_path is not None:
        np.save(outputs_path, outputs)
    quality = family.judge(outputs, data, reference)
    if data.lengths is not None:  # padded batches: does a sample's output depend on its batch companions?
        quality = family.with_batch_consistency(quality, *batch_consistency(session, data, max(1, proto.batch_size), reference))
    failed = family.gate_failure(quality, gate) if gate else None
    failed = "; ".join(f for f in (failed, ran_as_asked(session.info())) if f) or None
    if failed:
        return Measured(status="failed", error=f"verification failed: {failed}", quality=quality)
    single = measure_latency(session, data, proto)
    batch = measure_batch(session, data, proto, proto.batch_size)
    sweep = {str(bs): measure_batch(session, data, proto, bs, name=f"batch-{bs}") for bs in proto.sweep}
    grid, batching, more = measure_text_axes(session, data, family, proto)
    return Measured(
        quality=quality, latency_ms=single.latency,
        throughput_ips=Throughput(single=single.throughput, batch=batch.throughput,
                                  sweep={k: v.throughput for k, v in sweep.items()} or None),
        batch_latency_ms=batch.latency, latency_samples_ms=single.samples_ms,
        interference=Interference(single=single.interference, batch=batch.interference,
                                  flagged=single.interference.flagged or batch.interference.flagged),
        stopped_by={"single": single.stopped_by, "batch": batch.stopped_by},
        phases=[single.phase, batch.phase, *(p.phase for p in sweep.values()), *more],
        grid=grid, length_batching=batching,
    )


def measure_text_axes(session: Session, data: Dataset, family: Family, proto: Protocol
                      ) -> tuple[list[GridPoint] | None, LengthBatching | None, list[Phase]]:
    """The batch × sequence-length grid, and the real samples batched first-come vs sorted by length, where the
    family has those axes (text encoders); timed with the same loop and stopping rule as every phase."""
    grid: list[GridPoint] = []
    phases: list[Phase] = []
    for batch, length in proto.grid:
        feed = family.grid_feed(data, batch, length)
        if feed is None:
            break
        r = _phase(f"grid-{batch}x{length}", session.run_prepared, [session.prepare(feed)], proto, proto.batch_min_runs,
                   proto.batch_min_seconds, 1, batch)
        grid.append(GridPoint(batch=batch, sequence=length, p50_ms=r.latency.p50, throughput_ips=r.throughput,
                              tokens_per_s=r.throughput * length))
        phases.append(r.phase)
    batching = None
    lb = family.length_batches(data, proto.batch_size) if proto.length_batching else None
    if lb is not None:
        timed = {}
        for name, feeds in (("first_come", lb.first_come), ("sorted", lb.sorted)):
            prepared = [session.prepare(f) for f in feeds]
            start = time.time()
            session.run_prepared(prepared[0])  # warm-up
            t0 = time.perf_counter()
            rounds = 0
            while rounds < 1 or time.perf_counter() - t0 < proto.batch_min_seconds:  # whole passes (one: 15+ calls)
                for p in prepared:
                    session.run_prepared(p)
                rounds += 1
            timed[name] = rounds * len(data) / (time.perf_counter() - t0)
            phases.append(Phase(name=f"texts-{name}", start=start, stop=time.time(), node=node_name()))
        batching = LengthBatching(batch_size=proto.batch_size, first_come_ips=timed["first_come"], sorted_ips=timed["sorted"],
                                  first_come_waste=lb.first_come_waste, sorted_waste=lb.sorted_waste,
                                  sorted_tokens_per_s=timed["sorted"] * lb.real_tokens / len(data))
    return grid or None, batching, phases


def batch_consistency(session: Session, data: Dataset, batch_size: int,
                      reference: np.ndarray | None = None, samples: int = 32) -> tuple[float, float, float | None]:
    """The first ``samples`` run alone and as one batch in arrival order, padded to the longest of them (the most
    padding a server could give them): the mean and lowest cosine between the two, and the mean cosine of the alone
    outputs to ``reference`` (None without one)."""
    from servopt.families.metrics import cosine

    n = min(samples, len(data), batch_size)
    alone = np.concatenate([session.run(data.slice(i, i + 1)) for i in range(n)])
    both = cosine(alone, session.run(data.slice(0, n)))
    to_ref = float(cosine(alone, reference[:n]).mean()) if reference is not None else None
    return float(both.mean()), float(both.min()), to_ref


def precision_matches(asked: str, ran: str) -> bool:
    """``ran`` is ``asked``, possibly with how (``int8 (QDQ)``, ``fp16 (TensorRT)``, ``bf16 (autocast over fp32 weights)``)."""
    return ran == asked or ran.startswith(asked + " ")


def ran_as_asked(info: SessionInfo) -> str | None:
    """Why a session does not run what its variant asked for, or None: a provider that fell back (ONNX Runtime runs on
    the CPU when CUDA or TensorRT cannot start, and says so only when asked) or a precision other than the one asked
    for (OpenVINO's bf16 default, an fp16 pass that changed nothing, an INT8 model run in float). Such a variant fails
    verification, whatever the runtime: its figures would be recorded under a name that is not what ran."""
    problems = []
    if info.provider_fallback:
        ran = info.details.get("providers")
        problems.append(f"the variant asked for {info.provider_requested} but {info.runtime} ran on {info.provider_actual}"
                        + (f" (providers that ran: {', '.join(ran)})" if ran else ""))
    asked, ran = info.precision_requested, info.precision_actual
    if asked and ran and ran != "unknown" and not precision_matches(asked, ran):
        problems.append(f"the variant asked for {asked} but {info.runtime} runs {ran} ({info.details.get('precision_source', '')})")
    return "; ".join(problems) or None
