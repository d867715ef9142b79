"""The typed contracts that cross module and process boundaries.

A measurement job's inputs and outputs, the artifact a pass builds, what a
runtime says actually ran, and the record ``results.jsonl`` stores are pydantic
models, so a field is declared once, validated where it enters, and the JSON
Schema in ``schema/result.schema.json`` is generated from ``Record`` itself
(``python -m servopt.results``): the documented schema cannot drift from the code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servopt.spec import ModelSpec

RESULT_SCHEMA = "servopt.result/2"
BENCH_SCHEMA = "servopt.bench/2"
SUMMARY_SCHEMA = "servopt.summary/2"


class Contract(BaseModel):
    """Strict by default: an unknown field is a bug in the writer, not something to carry silently."""

    model_config = ConfigDict(extra="forbid")


class ModelRef(Contract):
    """Everything another process needs to load a source model again."""

    kind: str  # onnx | torchscript | exported_program | state_dict | pickle | hf_encoder
    path: str
    arch: str | None = None
    num_classes: int | None = None
    trust_pickle: bool = False
    spec: ModelSpec


class Artifact(Contract):
    """A model a runtime can open: an ONNX file, an OpenVINO IR, or a reference to a torch source."""

    format: Literal["onnx", "openvino", "torch"]
    path: str | None = None  # the file to open (onnx, openvino)
    ref: ModelRef | None = None  # torch: how to load the source module
    size_file: str | None = None  # torch: a file saved to measure the variant's size on disk
    hash: str | None = None  # content hash of the source + chain, for the build cache
    # A digest of the calibration and tuning data the chain's passes may read (``passes.base.build_data_key``): part of
    # the cache key of every step that reads data, so other data (or another sample count) builds anew.
    data_key: str | None = None
    built_by: str | None = None  # the pass that produced it
    params: dict[str, Any] | None = None  # that pass's parameters, defaults filled in
    report: dict[str, Any] | None = None  # that pass's build report (e.g. the accuracy-aware search)

    def opened(self) -> Artifact:
        """The same artifact without its build report: what a measuring process needs."""
        return self.model_copy(update={"report": None})


class SessionInfo(Contract):
    """What ACTUALLY ran, read back from the runtime after loading (never assumed from the request)."""

    runtime: str
    provider_requested: str
    provider_actual: str
    provider_fallback: bool = False
    precision_requested: str | None = None  # what the variant asked for: fp32, bf16, fp16, int8
    precision_actual: str | None = None  # what the runtime reports it runs
    threads: int | str | None = None
    details: dict[str, Any] = Field(default_factory=dict)  # runtime-specific: graph level, hint, streams, mode …


class Environment(Contract):
    cpu: str
    cpu_flags: list[str] = Field(default_factory=list)
    cores: int | None = None
    cores_usable: int | None = None
    gpu: bool = False
    gpu_name: str | None = None
    node: str | None = None  # the node that measured: SERVOPT_NODE (a Ray node of a distributed sweep) or the host name
    python: str = ""
    platform: str = ""
    libraries: dict[str, str] = Field(default_factory=dict)
    isa_cap: str | None = None  # an instruction-set cap the measurement ran under (oneDNN / ATen)
    runtime_env: str | None = None  # the runtime's own Python environment it ran in (servopt.envs: name-key)
    session: SessionInfo | None = None


class Accuracy(Contract):
    """Top-k against labels; a tie for the top score counts as ``numpy.argmax`` does (the first index)."""

    top1: float
    top5: float
    correct: int
    correct_top5: int | None = None
    total: int
    ties: int | None = None  # samples whose top score is shared by several classes


class Agreement(Contract):
    """How closely a variant reproduces the original on the same inputs."""

    max_abs_diff: float | None = None
    mean_abs_diff: float | None = None
    total: int | None = None
    cosine_min: float | None = None
    cosine_mean: float | None = None
    cosine_p1: float | None = None
    top1_agreement: float | None = None
    agree: int | None = None
    retrieval_top10: float | None = None  # overlap of nearest-neighbour lists (embeddings)
    # Variable-length inputs: the mean (and lowest) cosine between a sample's output run alone and run inside a padded
    # batch, and the mean cosine to the original of the outputs run alone. Dynamic INT8 takes its activation scale over
    # the whole padded batch, so a text's embedding depends on what it is batched with — which a server's batcher
    # decides; the quality bound must hold either way.
    batch_consistency: float | None = None
    batch_consistency_min: float | None = None
    cosine_mean_alone: float | None = None
    error: str | None = None


class PairsQuality(Contract):
    """How well embedding similarity ranks scored pairs: Spearman correlation of cosine with the scores."""

    spearman: float
    pairs: int


class Gate(Contract):
    """Verification bounds: a variant outside them is recorded as failed with its figures and never timed."""

    reference_top1: float | None = None
    max_drop_points: float = 5.0
    min_agreement: float = 0.9
    min_cosine: float | None = None


class Latency(Contract):
    p50: float
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None
    stdev: float | None = None
    min: float | None = None
    max: float | None = None
    n: int | None = None
    p50_ci95: list[float] | None = None


class Throughput(Contract):
    single: float | None = None
    batch: float | None = None
    sweep: dict[str, float] | None = None


class CpuReport(Contract):
    wall_s: float
    own_cpu_s: float
    other_cpu_s: float
    steal_s: float
    other_share: float
    flagged: bool


class Interference(Contract):
    single: CpuReport | None = None
    batch: CpuReport | None = None
    flagged: bool = False


class ColdStart(Contract):
    total_s: float | None = None
    imports_s: float | None = None
    load_s: float | None = None
    first_inference_s: float | None = None
    peak_rss_mb: float | None = None
    compile_s: float | None = None
    error: str | None = None


class GridPoint(Contract):
    """Latency and throughput at one batch size × sequence length (text encoders)."""

    batch: int
    sequence: int
    p50_ms: float
    throughput_ips: float
    tokens_per_s: float


class LengthBatching(Contract):
    """Throughput on the real texts, batched as they come vs sorted by length, and the padding each wastes."""

    batch_size: int
    first_come_ips: float
    sorted_ips: float
    first_come_waste: float  # padded tokens per real token
    sorted_waste: float
    sorted_tokens_per_s: float


class Phase(Contract):
    """A timed phase with wall-clock start/stop (seconds since the epoch) and the node it ran on: proves measurements
    never overlapped on one machine."""

    name: str
    start: float
    stop: float
    node: str | None = None


class Measured(Contract):
    """What a measuring process returns (the worker job)."""

    status: Literal["ok", "failed"] = "ok"
    error: str | None = None
    accuracy: Accuracy | None = None
    agreement: Agreement | None = None
    pairs: PairsQuality | None = None
    latency_ms: Latency | None = None
    batch_latency_ms: Latency | None = None
    latency_samples_ms: list[float] | None = None
    throughput_ips: Throughput | None = None
    interference: Interference | None = None
    stopped_by: dict[str, str] | None = None
    grid: list[GridPoint] | None = None
    length_batching: LengthBatching | None = None
    environment: Environment | None = None
    load_s: float | None = None
    compile_s: float | None = None
    phases: list[Phase] = Field(default_factory=list)


class ChainStep(Contract):
    pass_name: str
    params: dict[str, Any] = Field(default_factory=dict)


class Record(Contract):
    """One measured (or skipped, or failed) variant: a line of ``results.jsonl``, an entry of ``bench --json``."""

    schema_: str = Field(RESULT_SCHEMA, alias="schema")
    key: str | None = None
    name: str
    group: str | None = None
    runtime: str
    chain: list[ChainStep] = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    description: str = ""
    needs_gpu: bool = False
    status: Literal["ok", "failed", "skipped"]
    stage: Literal["build", "measure"] | None = None
    error: str | None = None
    artifact: Artifact | None = None
    size_mb: float | None = None
    batch_size: int | None = None
    accuracy: Accuracy | None = None
    agreement: Agreement | None = None
    pairs: PairsQuality | None = None
    latency_ms: Latency | None = None
    batch_latency_ms: Latency | None = None
    latency_samples_ms: list[float] | None = None
    throughput_ips: Throughput | None = None
    cold_start: ColdStart | None = None
    interference: Interference | None = None
    stopped_by: dict[str, str] | None = None  # per timed phase: "rule" (both minimums met) or "max_seconds"
    grid: list[GridPoint] | None = None  # text encoders: batch × sequence length
    length_batching: LengthBatching | None = None  # text encoders: real texts, first-come vs sorted by length
    environment: Environment | None = None
    load_s: float | None = None
    compile_s: float | None = None
    build_s: float | None = None
    phases: list[Phase] = Field(default_factory=list)
    # A distributed sweep: the kind of node it was measured for (a label of the targets' Ray resources, e.g. "epyc-7763");
    # only the targets of that kind are decided on it. None: one machine measured it for every target.
    measured_for: str | None = None
    # A racing sweep: why this variant got no cold start nor side-by-side re-measure (what beat it beyond noise, for
    # every target it could serve). None: a contender, or a full sweep.
    screened_out: str | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @property
    def cold_start_s(self) -> float | None:
        return self.cold_start.total_s if self.cold_start else None

    @property
    def peak_rss_mb(self) -> float | None:
        return self.cold_start.peak_rss_mb if self.cold_start else None

    @property
    def p50_ms(self) -> float | None:
        return self.latency_ms.p50 if self.latency_ms else None

    @property
    def batch_ips(self) -> float | None:
        return self.throughput_ips.batch if self.throughput_ips else None

    @property
    def build_report(self) -> dict[str, Any] | None:
        return self.artifact.report if self.artifact else None


class SideBySide(Contract):
    """One variant in an interleaved re-measure: medians over rounds, and medians of per-round ratios."""

    p50_ms: float
    throughput_ips: float
    p50_ms_rounds: list[float]
    throughput_rounds: list[float]
    p50_ratio_vs_reference: float
    throughput_ratio_vs_reference: float
    flagged_rounds: int
    isa_cap: str | None = None  # the instruction set this variant's runtime was held to in this run (None: not capped)


class Interleaved(Contract):
    reference: str
    rounds: int
    order: list[str]
    variants: dict[str, SideBySide]
    failed: dict[str, str] = Field(default_factory=dict)  # variants that could not even open here (e.g. bf16 under an AVX2 cap)
    environment: Environment | None = None
    phases: list[Phase] = Field(default_factory=list)
    cache_key: str | None = None


class OpTime(Contract):
    op: str
    ms_per_run: float
    share: float
    calls_per_run: float


class OpProfile(Contract):
    """Where the time goes, op by op (a profile job's result)."""

    variant: str = ""
    profiler: str
    total_ms_per_run: float
    ops: list[OpTime] = Field(default_factory=list)
    error: str | None = None
