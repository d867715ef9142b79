"""One measurement (``Measured``: latency, throughput, cold start, CPU, the text grid) and the record
``results.jsonl`` stores (``Record``), from which the result JSON Schema is generated."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from servopt.contracts.artifacts import Artifact
from servopt.contracts.base import RESULT_SCHEMA, Contract
from servopt.contracts.environment import Environment
from servopt.contracts.quality import AnyQuality, parse_quality


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
    quality: AnyQuality | None = None
    tuning_quality: AnyQuality | None = None
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

    _quality = field_validator("quality", "tuning_quality", mode="before")(parse_quality)


class ChainStep(Contract):
    pass_name: str
    params: dict[str, Any] = Field(default_factory=dict)


class Record(Contract):
    """One measured (or skipped, or failed) variant: a line of ``results.jsonl``, an entry of ``bench --json``."""

    schema_: str = Field(RESULT_SCHEMA, alias="schema", description="the record's version; a change that breaks readers bumps it")
    key: str | None = Field(None, description="identity of the measurement (variant, chain with defaults filled in, protocol, "
                                              "data and calibration data; on a distributed sweep the kind of node): same key, "
                                              "not measured again")
    name: str = Field(description="the variant")
    group: str | None = Field(None, description="its group in the catalogue (pytorch, onnxruntime, int8, openvino, fp16, gpu, lab)")
    runtime: str = Field(description="the registered runtime that ran it")
    chain: list[ChainStep] = Field(default_factory=list, description="the passes that built the artifact, parameters with "
                                                                     "defaults filled in")
    options: dict[str, Any] = Field(default_factory=dict, description="the runtime's options")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables of its processes")
    description: str = Field("", description="what the variant is, in words")
    refines: str | None = Field(None, description="the variant whose lost quality it recovers (a racing sweep builds it only "
                                                  "when that one misses a quality bound); among variants equally fast, the "
                                                  "decision prefers the one it refines")
    catalogue_index: int | None = Field(None, description="its place in its family's catalogue, which lists each variant's "
                                                          "refinements cheapest first (the order a race builds them in): "
                                                          "the decision's last word between equally fast, equally simple "
                                                          "recipes")
    needs_gpu: bool = Field(False, description="its runtime computes on a GPU")
    status: Literal["ok", "failed", "skipped"] = Field(description="ok; failed (with error, stage build or measure); skipped "
                                                                   "(the reason in error)")
    stage: Literal["build", "measure"] | None = Field(None, description="where a failed variant failed")
    error: str | None = Field(None, description="why it failed or was skipped")
    artifact: Artifact | None = Field(None, description="what was measured: format, path (or the torch source's ref), hash, "
                                                        "the pass that built it and its report (e.g. the accuracy-aware search)")
    size_mb: float | None = Field(None, description="size on disk of every file of the model, external data included (10⁶ bytes)")
    batch_size: int | None = Field(None, description="the batch size of the throughput run")
    quality: AnyQuality | None = Field(None, description="the model family's judgement against the original (and labels), one "
                                                         "kind per family, told apart by `kind` (the tables below), on "
                                                         "the held-out evaluation samples no choice saw: what the verdict "
                                                         "reads")
    tuning_quality: AnyQuality | None = Field(None, description="the same judgement on the tuning samples (those calibration, "
                                                                "refinements and searches chose on): what a racing sweep's "
                                                                "refinement ladder decides \"recovered?\" on. null: no "
                                                                "tuning data (servopt bench), or the variant failed before")
    latency_ms: Latency | None = Field(None, description="single-sample latency: p50, p90, p95, p99, mean, stdev, min, max, n, "
                                                         "and p50_ci95, a distribution-free 95 % interval of the median")
    batch_latency_ms: Latency | None = Field(None, description="the same statistics for one batch of batch_size")
    latency_samples_ms: list[float] | None = Field(None, description="a few hundred raw single-sample latencies (distribution plots)")
    throughput_ips: Throughput | None = Field(None, description="single (1 / mean latency), batch (samples/s at batch_size), "
                                                               "sweep ({batch size: samples/s})")
    cold_start: ColdStart | None = Field(None, description="a fresh process: total_s (start, imports, load, first answer, timed "
                                                           "from outside), imports_s, load_s, first_inference_s, peak_rss_mb, "
                                                           "compile_s; a racing sweep measures it for contenders only")
    interference: Interference | None = Field(None, description="per timed phase: wall and CPU seconds of this process, of "
                                                                "others and stolen; flagged when others used the CPU")
    stopped_by: dict[str, str] | None = Field(None, description="per timed phase: rule (both minimums met) or max_seconds")
    grid: list[GridPoint] | None = Field(None, description="inputs with a sequence axis: latency and throughput per batch × length")
    length_batching: LengthBatching | None = Field(None, description="inputs of varying length: the real samples in arrival "
                                                                     "order vs sorted by length, with the padding each wastes")
    environment: Environment | None = Field(None, description="the machine (CPU model and flags, cores, GPU, node), the "
                                                              "libraries, an ISA cap, the runtime's own environment, and the "
                                                              "session: what ACTUALLY ran (provider, precision, threads)")
    load_s: float | None = Field(None, description="session creation, seconds")
    compile_s: float | None = Field(None, description="torch.compile, seconds")
    build_s: float | None = Field(None, description="building its artifact, seconds")
    phases: list[Phase] = Field(default_factory=list, description="every timed phase's name, start, stop and node: proof that no "
                                                                  "two measurements overlapped on one machine")
    measured_for: str | None = Field(None, description="a distributed sweep: the kind of node it was measured for (a label of "
                                                       "its targets' Ray resources); only targets of that kind are decided on "
                                                       "it. null: one machine measured it for every target")
    screened_out: str | None = Field(None, description="a racing sweep: what beat it beyond noise for every target it could "
                                                       "serve (it got no cold start nor side-by-side re-measure). null: a "
                                                       "contender, or a full sweep")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    _quality = field_validator("quality", "tuning_quality", mode="before")(parse_quality)

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
