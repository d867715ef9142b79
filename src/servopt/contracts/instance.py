"""The target's instance: scaling curves, the projection with its band and check, serving configurations, load
steps, the data a capacity search sends and the capacity it found."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from servopt.contracts.base import Contract
from servopt.contracts.environment import Environment


# ---------------------------------------------------------------------------------------------- the instance's answer
class ScalingPoint(Contract):
    """One core count of a scaling measurement: ``instances`` single-thread sessions working at once (the throughput
    layout ``servopt serve`` runs: one instance per core), and one session with ``cores`` threads answering one sample
    at a time (what a lone request gets). One figure per round."""

    cores: int
    instances: int
    threads_per_instance: int
    throughput_ips: list[float]  # samples/s of all instances together, at the batch size, per round
    p50_ms: list[float]  # single-sample p50 of one session with ``cores`` threads, per round
    # the share of the machine OTHER processes used while each round's two figures were taken (``bench.interference``):
    # on a shared machine N instances may get fewer than N cores, and the fit would read that as the model's scaling
    other_share: list[float] = Field(default_factory=list)


class ScalingCurve(Contract):
    """A variant measured at 1, 2, … cores of this machine (``bench.scaling``)."""

    variant: str
    batch_size: int
    points: list[ScalingPoint] = Field(default_factory=list)
    error: str | None = None


class Scaling(Contract):
    """The result of a ``ScalingJob``: every variant's curve, taken in rounds that alternate the variants' order."""

    curves: dict[str, ScalingCurve]
    rounds: int
    environment: Environment | None = None
    cache_key: str | None = None
    isa_cap: str | None = None  # the instruction set the runtimes were held to, where they could be


class Allowance(Contract):
    """Something the band of a projected figure holds beyond the scaling rounds' noise (``optimize.allowance``), as
    factors of the central figure its two ends were multiplied by: the served capacity's spread from one search to the
    next, the CPU change where the figures could not be held to the target's instruction set."""

    what: Literal["served", "cpu"]
    low: float  # the factor at the band's low end (≤ 1)
    high: float  # at its high end (≥ 1)
    measured: bool  # measured here (the searches' own spread); False: stated, with its source in ``words``
    words: str


class ProjectionCheck(Contract):
    """The law checked where it can be: fitted on the one-vCPU rounds alone (the host read from its sibling lists,
    each unmeasured factor at its stated range), the two-vCPU figure predicted and compared with the one measured
    (held out)."""

    predicted: float
    low: float
    high: float
    measured: float
    error: float  # measured / predicted − 1
    within: bool  # the measured figure lies in the prediction's band
    reading: str  # how the second vCPU was read for the prediction


class Projection(Contract):
    """A figure of the target's instance, projected from the cores measured here (``optimize.scaling``)."""

    figure: Literal["throughput_ips", "p50_ms"]
    # served capacity within the SLO; "estimated": the offline figure × the served/offline share another variant's
    # served capacity showed (a variant not served is judged like with like beside a served one); the offline batch loop
    basis: Literal["served", "estimated", "offline"] = "offline"
    to_cores: int
    cores_measured: list[int]
    value: float
    # the band's ends: the 95 % bootstrap interval over the rounds (and the repeated capacity searches), each unmeasured
    # factor at its range's end, times the allowances
    low: float
    high: float
    model: str  # the fitted law and its parameters, in words
    measured: bool = False  # the target's core count was measured: no extrapolation
    note: str = ""
    # the instance as physical cores × threads and the host as read (``optimize.layout``), e.g. "4 cores × 2 threads
    # from 2 cores × 1 thread here"; the factors not measured here, each with its range and source
    layout: str = ""
    assumed: list[str] = Field(default_factory=list)
    allowances: list[Allowance] = Field(default_factory=list)  # folded into low/high
    floored: bool = False  # the law went below a figure measured on fewer vCPUs: held there (a projection is monotone)
    check: ProjectionCheck | None = None  # throughput: the law fitted on 1 vCPU against the 2 measured

    @property
    def pessimistic(self) -> float:
        """The end a bound must be met at: the lowest throughput, the highest latency."""
        return self.low if self.figure == "throughput_ips" else self.high


class ServeConfig(Contract):
    """A serving configuration of ``servopt serve`` (what a capacity search explores)."""

    instances: int
    threads: int
    max_batch: int
    max_delay_us: int

    @property
    def label(self) -> str:
        return f"{self.instances}×{self.threads} threads, batch ≤ {self.max_batch}, wait ≤ {self.max_delay_us} µs"

    def serve_args(self) -> list[str]:
        """``servopt serve``'s options for this configuration."""
        return ["--instances", str(self.instances), "--threads", str(self.threads), "--max-batch", str(self.max_batch),
                "--max-delay-us", str(self.max_delay_us)]


class LoadStep(Contract):
    """One offered rate of a capacity search (an open loop of Poisson arrivals, latency from each scheduled time)."""

    rate_rps: float
    achieved_rps: float
    requests: int
    duration_s: float
    p50_ms: float | None
    p99_ms: float | None
    errors: int
    meets: bool  # valid, no errors, enough queries to claim the percentile, and it within the bound (a confirming run: 90 % of it)
    valid: bool  # the client kept to its schedule and sent every arrival
    confirming: bool = False
    late_ms: float | None = None  # the SLO's percentile over the requests scheduled in the step's second half
    to_bound: float | None = None  # the SLO's percentile over its bound (1.1: missed by 10 %)
    claim_ms: float | None = None  # the early-stopping estimate of the SLO's percentile (None: too few queries)
    over: int | None = None  # answers over the bound (refusals and errors among them)
    needed: int | None = None  # the queries the claim needed with that many over the bound
    confidence: float | None = None  # the claim's
    lag_p99_ms: float | None = None  # how late the client sent, against its schedule
    client_cpu_ms: float | None = None  # the load generator's CPU per request
    invalid: str | None = None  # why the step was not valid
    answers: dict[str, int] = Field(default_factory=dict)  # the answers not accepted, by status ("503", "no answer" …)
    rerun: bool = False  # run again because the step before it was not valid: the two are one vote, this one its answer


def confirming_votes(steps: list[LoadStep], rate: float) -> tuple[list[LoadStep], int]:
    """The confirming runs that voted at ``rate`` (a run not valid and rerun gives its vote to the rerun) and how many
    were rerun: CI's "confirmed by 2 of 4 runs" counted two client-bound attempts as runs that held nothing."""
    runs = [s for s in steps if s.confirming and abs(s.rate_rps - rate) < 1e-6]
    votes = [s for s, after in zip(runs, [*runs[1:], None], strict=True) if after is None or not after.rerun]
    return votes, len(runs) - len(votes)


class ServedData(Contract):
    """What a capacity search sends the served model: the user's evaluation data, as the server receives it (issue
    42). Tensors from ``eval_data`` (one sample a request) where the server takes the model's inputs; a text encoder's
    evaluation texts (its token ids decoded with ``tokenizer``: the server tokenizes) where it takes strings; the
    ``images`` files' bytes to ``/classify`` where the target says its clients send images."""

    eval_data: str  # the run's eval.npz
    tokenizer: str | None = None  # a text encoder's tokenizer.json
    images: list[str] = Field(default_factory=list)


class Capacity(Contract):
    """The highest arrival rate a served variant answers within its latency bound (MLPerf's server scenario, Triton
    model_analyzer's constraint search), on this machine's cores, with the configuration that gives it."""

    variant: str
    slo: str  # e.g. "p99 <= 50 ms"
    capacity_rps: float  # 0: not even the lowest rate tried met it
    config: ServeConfig | None = None
    steps: list[LoadStep] = Field(default_factory=list)  # the best configuration's search, the confirming run last
    tried: list[tuple[ServeConfig, float]] = Field(default_factory=list)  # each configuration and its capacity
    confirmed: bool = False
    knee_found: bool = True  # False: the step limit came before a failing rate, the capacity is a lower bound
    knee_rps: float | None = None  # the highest rate a short step met: the capacity is confirmed below it (headroom)
    stopped: str | None = None  # why the best configuration's search ended early (its time; a bound no rate meets)
    timed_out: bool = False  # no rate confirmed before the search's time ran out: not a capacity of 0
    cores: int | None = None
    batch_size: int = 1  # samples per request
    requests: str | None = None  # what was sent, in words ("the 312 evaluation texts, one a request, drawn at random")
    sender: str | None = None  # the load generator's sender (``serve.load.senders``)
    environment: Environment | None = None
    error: str | None = None
