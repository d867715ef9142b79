"""Typed measurement jobs, each run in a fresh process (``launcher.launch``, entry ``servopt.runjob``).

Running each job in its own process means one variant's allocator state,
thread pools or compiled kernels cannot disturb the next (optimum-benchmark,
Model Navigator). Every kind of job is declared here once, with the typed
result it returns; ``launcher.launch`` starts any of them the same way.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from servopt.bench.protocol import Protocol, measure_batch, measure_latency, measure_session, predict_all
from servopt.bench.rounds import side_by_side, take_turns
from servopt.contracts import (
    Artifact,
    ColdStart,
    Contract,
    Duels,
    Gate,
    Interference,
    Interleaved,
    Measured,
    OpProfile,
    Phase,
    Quality,
    Record,
    Throughput,
)
from servopt.spec import ModelSpec

if TYPE_CHECKING:
    from servopt.families.base import Family
    from servopt.runtimes.base import Session

READY = "servopt-job-ready"  # printed by a job that is timed from outside, at the moment it has its answer


class OpenSpec(Contract):
    """What a process needs to open a variant: its name, artifact, runtime and options."""

    name: str
    artifact: Artifact
    runtime: str
    options: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, rec: Record, artifact: Artifact | None = None) -> OpenSpec:
        """A measured variant opened as it ran: its name, its artifact (or ``artifact``: a build's, before the record
        holds it), runtime and options."""
        artifact = artifact or rec.artifact
        if artifact is None:
            raise ValueError(f"{rec.name} has no artifact to open")
        return cls(name=rec.name, artifact=artifact, runtime=rec.runtime, options=rec.options)

    def open(self):
        from servopt.runtimes import open_session

        return open_session(self.artifact, self.runtime, self.options)


class JobBase(Contract):
    """A unit of work run in a fresh process by ``launcher.launch``: ``python -m servopt.runjob job.json out.json``.
    Each kind declares its inputs (fields), its typed result, its time limit, and ``run`` (executed in that process);
    kinds register by name, so a layer above this one (passes: builds) adds its own."""

    kind: str
    result_type: ClassVar[type[Contract]]
    timeout_s: ClassVar[float] = 1800.0
    env: dict[str, str] = Field(default_factory=dict)  # extra environment variables (allocator settings, ISA caps)
    python: str | None = None  # the interpreter to run it with (a runtime's own environment); default: this one

    def run(self, started: float) -> Contract:
        """Do the work (in the job's own process); ``started`` is when that process started (perf_counter)."""
        raise NotImplementedError

    def runtimes(self) -> list[str]:
        """The runtimes this job opens: the launcher runs it in their Python environment when they have one."""
        return []


JOB_KINDS: dict[str, type[JobBase]] = {}


def register_job(cls: type[JobBase]) -> type[JobBase]:
    JOB_KINDS[cls.model_fields["kind"].default] = cls
    return cls


@register_job
class MeasureJob(JobBase):
    """Verify one variant against the original, then time it (the protocol)."""

    kind: Literal["measure"] = "measure"
    result_type: ClassVar[type[Contract]] = Measured
    session: OpenSpec
    data: str
    family: str
    reference: str | None = None  # the original's outputs (.npy) to judge against
    save_outputs: str | None = None
    protocol: Protocol
    gate: Gate | None = None
    # The tuning samples (.npz), judged too after the timing (``Measured.tuning_quality``): a refinement ladder chooses on
    # them, so the verdict's held-out samples stay unseen by any choice. The original's outputs on them, or where the
    # original saves its own.
    tuning_data: str | None = None
    tuning_reference: str | None = None
    save_tuning_outputs: str | None = None
    # only the tuning samples, nothing verified or timed: the original's judgement there, in a job beside the first
    # builds (two thirds of a PyTorch original's measurement were its outputs on the two splits)
    tuning_only: bool = False

    @classmethod
    def of_record(cls, rec: Record, data: str | Path, family: str, protocol: Protocol,
                  env: dict[str, str] | None = None) -> MeasureJob:
        """A measured variant timed again as it ran (its artifact, runtime, options and environment), ``env`` over its
        own (an ISA cap): what a re-measure or a benchmark alternates."""
        return cls(session=OpenSpec.of(rec),
                   data=str(data), family=family, protocol=protocol, env={**rec.env, **(env or {})})

    def run(self, started: float) -> Measured:
        return run_measure(self)

    def runtimes(self) -> list[str]:
        return [self.session.runtime]


@register_job
class ColdStartJob(JobBase):
    """Imports, load and one answer in a fresh process, timed from outside (spawn to answer)."""

    kind: Literal["coldstart"] = "coldstart"
    result_type: ClassVar[type[Contract]] = ColdStart
    timeout_s: ClassVar[float] = 900.0
    session: OpenSpec
    spec: ModelSpec

    def run(self, started: float) -> ColdStart:
        return run_coldstart(self, started)

    def runtimes(self) -> list[str]:
        return [self.session.runtime]


@register_job
class InterleaveJob(JobBase):
    """Candidates and a reference side by side in one process: A B … ref, A B … ref (same-run ratios)."""

    kind: Literal["interleave"] = "interleave"
    result_type: ClassVar[type[Contract]] = Interleaved
    sessions: list[OpenSpec]
    reference: str
    data: str
    protocol: Protocol
    rounds: int = 3

    def run(self, started: float) -> Interleaved:
        return run_interleave(self)

    def runtimes(self) -> list[str]:
        return [s.runtime for s in self.sessions]


@register_job
class DuelJob(JobBase):
    """A target's pick and its rivals, the close calls the interleaved rounds leave, taking turns block by block in
    one process (``bench.duel``): every pair on every figure asked."""

    kind: Literal["duel"] = "duel"
    result_type: ClassVar[type[Contract]] = Duels
    timeout_s: ClassVar[float] = 600.0
    sessions: list[OpenSpec]
    data: str
    batch_size: int = 32
    figures: list[Literal["p50_ms", "throughput_ips"]] = Field(default_factory=lambda: ["p50_ms", "throughput_ips"])
    seconds: float = 8.0  # per figure, at most
    tie_gap: float = 0.03  # a lead smaller than this is a tie
    z: float = 3.29  # the intervals' width: 99.9 % for one look; over a duel's looks a false lead stays under 1 % (tests)
    min_pairs: int = 8  # at 8, the interval is the range: every pair one way (1 in 128 by chance)

    def run(self, started: float) -> Duels:
        from servopt.bench.duel import take_turns
        from servopt.data.dataset import Dataset

        data = Dataset.load(Path(self.data))
        sessions = {}
        for spec in self.sessions:
            sessions[spec.name] = s = spec.open()
            s.warm_up(data.slice(0, 1))
        t0 = time.perf_counter()
        duels, phases = take_turns(sessions, data, self.batch_size, list(self.figures), self.seconds, self.tie_gap, self.z,
                                   self.min_pairs)
        return Duels(duels=duels, seconds=time.perf_counter() - t0, environment=_environment(None), phases=phases)

    def runtimes(self) -> list[str]:
        return [s.runtime for s in self.sessions]


@register_job
class ProfileJob(JobBase):
    """Where the time goes, op by op, for one variant."""

    kind: Literal["profile"] = "profile"
    result_type: ClassVar[type[Contract]] = OpProfile
    timeout_s: ClassVar[float] = 600.0
    session: OpenSpec
    data: str
    runs: int = 30
    top: int = 12

    def run(self, started: float) -> OpProfile:
        return run_profile(self)

    def runtimes(self) -> list[str]:
        return [self.session.runtime]




def _environment(session):
    from servopt.machine import environment
    from servopt.runtimes import all_libraries

    return environment(session.info() if session is not None else None, all_libraries())


def run_measure(job: MeasureJob) -> Measured:
    from servopt.data.dataset import Dataset
    from servopt.families import FAMILIES

    family = FAMILIES.get(job.family)
    if job.tuning_only:
        session = job.session.open()
        return Measured(tuning_quality=judge_tuning(session, job, family), environment=_environment(session))
    data = Dataset.load(Path(job.data))
    reference = np.load(job.reference) if job.reference else None
    start = time.perf_counter()
    session = job.session.open()
    load_s = time.perf_counter() - start
    compile_s = session.warm_up(data.slice(0, 1))
    result = measure_session(session, data, reference, family, job.protocol,
                             Path(job.save_outputs) if job.save_outputs else None, job.gate)
    if job.tuning_data and result.quality is not None and not job.protocol.axes_only:
        result = result.model_copy(update={"tuning_quality": judge_tuning(session, job, family)})
    return result.model_copy(update={"load_s": load_s, "compile_s": compile_s, "environment": _environment(session)})


def judge_tuning(session: Session, job: MeasureJob, family: Family) -> Quality:
    """The variant judged on the tuning samples, as on the evaluation ones (after the timing: nothing timed waits on
    it); the original saves its outputs there for the others'."""
    from servopt.data.dataset import Dataset

    assert job.tuning_data is not None
    tuning = Dataset.load(Path(job.tuning_data))
    outputs = predict_all(session, tuning, max(1, job.protocol.batch_size))
    if job.save_tuning_outputs:
        np.save(job.save_tuning_outputs, outputs)
    reference = np.load(job.tuning_reference) if job.tuning_reference else None
    return family.judge(outputs, tuning, reference)


def peak_rss_kb() -> int:
    """This process's peak resident memory. ``ru_maxrss`` is not used: Linux carries it over fork+exec, so a child
    would report its parent's peak; ``VmHWM`` belongs to this address space."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_coldstart(job: ColdStartJob, t0: float) -> ColdStart:
    from servopt.data.dataset import synthetic_inputs

    feed = synthetic_inputs(job.spec, count=1, shape_overrides={d: 16 for t in job.spec.inputs for d in t.named_dims}).slice(0, 1)
    t1 = time.perf_counter()
    session = job.session.open()
    t2 = time.perf_counter()
    compile_s = session.warm_up(feed)
    t3 = time.perf_counter()
    print(READY, flush=True)  # the launcher stops its clock here: spawn → imports → load → first answer
    return ColdStart(imports_s=t1 - t0, load_s=t2 - t1, first_inference_s=t3 - t2, peak_rss_mb=peak_rss_kb() / 1024,
                     compile_s=compile_s or None)


def run_interleave(job: InterleaveJob) -> Interleaved:
    from servopt.data.dataset import Dataset
    from servopt.errors import UserError

    data = Dataset.load(Path(job.data))
    sessions, failed = {}, {}
    for spec in job.sessions:
        try:
            s = spec.open()
            s.warm_up(data.slice(0, 1))
        except UserError as e:
            if spec.name == job.reference:
                raise
            failed[spec.name] = e.problem  # e.g. a bf16 model under an AVX2 cap: it cannot run there at all
            continue
        sessions[spec.name] = s
    phases: list[Phase] = []

    def measure(name: str, _round: int) -> Measured:
        single = measure_latency(sessions[name], data, job.protocol, name=f"{name}:single")
        batch = measure_batch(sessions[name], data, job.protocol, job.protocol.batch_size, name=f"{name}:batch")
        phases.extend([single.phase, batch.phase])
        return Measured(latency_ms=single.latency, throughput_ips=Throughput(batch=batch.throughput),
                        interference=Interference(flagged=single.interference.flagged or batch.interference.flagged))

    # the reference first, then the candidates; the order flipped every round (``bench.rounds``): a fixed order ran the
    # same variant first in every round, and whichever way the machine drifted within a round favoured it each time
    names = [job.reference, *[n for n in sessions if n != job.reference]]
    taken = take_turns(names, job.rounds, measure)
    summary = side_by_side({n: [m for m in ms if m is not None] for n, ms in taken.measured.items()}, job.reference)
    return Interleaved(reference=job.reference, rounds=len(taken.order), order=names, variants=summary, failed=failed,
                       environment=_environment(None), phases=phases)


def run_profile(job: ProfileJob) -> OpProfile:
    from servopt.data.dataset import Dataset

    data = Dataset.load(Path(job.data))
    session = job.session.open()
    feeds = [data.slice(i, i + 1) for i in range(min(job.runs, len(data)))]
    session.warm_up(feeds[0])
    return session.profile(feeds, job.runs, job.top).model_copy(update={"variant": job.session.name})
