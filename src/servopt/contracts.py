"""The typed contracts that cross module and process boundaries.

A measurement job's inputs and outputs, the artifact a pass builds, what a
runtime says actually ran, and the record ``results.jsonl`` stores are pydantic
models, so a field is declared once, validated where it enters, and the JSON
Schema in ``schema/result.schema.json`` is generated from ``Record`` itself
(``python -m servopt.results``): the documented schema cannot drift from the code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, field_validator

from servopt.cpu import CpuFeatures, Isa
from servopt.spec import ModelSpec

RESULT_SCHEMA = "servopt.result/3"
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


class Topology(Contract):
    """How the logical CPUs a process may use sit on physical cores (sysfs: each CPU's ``topology/thread_siblings_list``,
    what lscpu's "Thread(s) per core" is read from). A 2-vCPU cloud VM is often one core's two hyperthreads: a second
    instance there adds what SMT adds, not a core (``optimize.layout``)."""

    cpus: int  # logical CPUs usable here (the affinity mask)
    cores: int  # the physical cores they sit on
    threads_per_core: int  # the most usable logical CPUs one core holds
    siblings: list[list[int]] = Field(default_factory=list)  # the usable logical CPUs grouped by core
    source: Literal["sysfs", "unknown"] = "sysfs"  # unknown: no sysfs (not Linux): each CPU read as a core


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
    # servopt read the CPU as one stopping at this rung (SERVOPT_CPU_READ_AS): cpu_flags lack the richer rungs' features,
    # which the runtimes' kernels still used
    cpu_read_as: str | None = None

    @property
    def isa(self) -> Isa | str:
        """The richest rung of the instruction-set ladder the measuring CPU reached (``CpuFeatures.level``), from its
        recorded flags: what a figure was measured with, never this machine's."""
        return CpuFeatures(frozenset(self.cpu_flags)).level
    runtime_env: str | None = None  # the runtime's own Python environment it ran in (servopt.envs: name-key)
    session: SessionInfo | None = None
    topology: Topology | None = None  # cores × threads of the CPUs it ran on (None: a record of an older servopt)


class Accuracy(Contract):
    """Top-k against labels; a tie for the top score counts as ``numpy.argmax`` does (the first index)."""

    top1: float
    top5: float
    correct: int
    correct_top5: int | None = None
    total: int
    ties: int | None = None  # samples whose top score is shared by several classes
    # Paired with the original on the same samples: how many it got right that this one got wrong (lost) and the reverse
    # (gained), and the top-1 drop in points with its 95 % interval (Bonett and Price's paired interval; docs/targets.md
    # "How sure a quality verdict is"). None on the original itself, or without its outputs.
    lost: int | None = None
    gained: int | None = None
    drop_points: float | None = None
    drop_low: float | None = None
    drop_high: float | None = None


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
    # Classifiers: top-1 agreement split by the original's confidence (top-1 p > 0.5: "confident"; the softmax of logits,
    # probabilities as they are: ModelSpec.output_kind), with counts.
    # Where the original hesitates its argmax is nearly a coin toss; the verification gate reads the confident part.
    confident_total: int | None = None
    confident_agree: int | None = None
    top1_agreement_confident: float | None = None
    unsure_total: int | None = None
    unsure_agree: int | None = None
    top1_agreement_unsure: float | None = None
    error: str | None = None


class PairsQuality(Contract):
    """How well embedding similarity ranks scored pairs: Spearman correlation of cosine with the scores."""

    spearman: float
    pairs: int
    # Against the original on the same pairs: the Spearman drop in points and its 95 % interval (a seeded paired bootstrap
    # over the pairs; docs/targets.md "How sure a quality verdict is"). None on the original itself.
    drop_points: float | None = None
    drop_low: float | None = None
    drop_high: float | None = None


class Quality(Contract):
    """A model family's judgement of a variant: one kind per family (``Family.judge`` makes it), a discriminated union in
    ``Record.quality``. A family with figures of its own declares a ``Quality`` subclass and registers it
    (``register_quality``): nothing else changes."""

    kind: str = Field(description="which family's judgement this is (the union's discriminator)")


# A record's quality, serialized as what it is (its family's kind), not as the base class.
AnyQuality = SerializeAsAny[Quality]
QUALITY_KINDS: dict[str, type[Quality]] = {}


def register_quality(cls: type[Quality]) -> type[Quality]:
    kind = cls.model_fields["kind"].default
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} must give its kind a default (the discriminator)")
    QUALITY_KINDS[kind] = cls
    return cls


@register_quality
class ClassificationQuality(Quality):
    """Classifiers: top-k against labels, and agreement with the original's answers."""

    kind: Literal["classification"] = "classification"
    accuracy: Accuracy | None = Field(None, description="top1, top5, correct, correct_top5, total, ties on the labelled split; "
                                                        "paired with the original on the same samples: lost, gained, "
                                                        "drop_points and its 95 % interval drop_low … drop_high (points); "
                                                        "null without labels")
    agreement: Agreement | None = Field(None, description="against the original on the same inputs: max_abs_diff, "
                                                          "mean_abs_diff, cosine_*, top1_agreement, agree; split by the "
                                                          "original's top-1 p > 0.5 (logits through a softmax, "
                                                          "probabilities as they are): confident_total, "
                                                          "confident_agree, top1_agreement_confident (what the gate reads), "
                                                          "unsure_total, unsure_agree, top1_agreement_unsure")


@register_quality
class EmbeddingQuality(Quality):
    """Embedding models: closeness to the original's vectors, and ranking of scored pairs."""

    kind: Literal["embedding"] = "embedding"
    agreement: Agreement | None = Field(None, description="against the original: cosine_min, cosine_mean, cosine_p1, "
                                                          "retrieval_top10; inputs of varying length also batch_consistency "
                                                          "(alone vs in a padded batch), its lowest, and cosine_mean_alone")
    pairs: PairsQuality | None = Field(None, description="with scored pairs: Spearman correlation of cosine with the scores, "
                                                         "and the number of pairs; against the original's on the same "
                                                         "pairs: drop_points and its 95 % interval drop_low … drop_high")


class OtherQuality(Quality):
    """The quality of a family not installed here: its fields kept as they were, so its records still read."""

    model_config = ConfigDict(extra="allow")


def parse_quality(value: Any) -> Any:
    """A stored quality back as its family's class, chosen by ``kind``."""
    if not isinstance(value, dict):
        return value
    return QUALITY_KINDS.get(value.get("kind"), OtherQuality).model_validate(value)


class Gate(Contract):
    """Verification bounds: a variant outside them is recorded as failed with its figures and never timed."""

    reference: AnyQuality | None = None  # the original's quality, to compare with
    max_drop_points: float = 5.0
    min_agreement: float = 0.9
    min_cosine: float | None = None

    _quality = field_validator("reference", mode="before")(parse_quality)


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


class SideBySide(Contract):
    """One variant in an interleaved re-measure: medians over rounds, and medians of per-round ratios."""

    p50_ms: float
    throughput_ips: float
    p50_ms_rounds: list[float]
    throughput_rounds: list[float]
    p50_ratio_vs_reference: float
    throughput_ratio_vs_reference: float
    # the per-round ratios' median's interval (``bench.stats.median_interval``; with few rounds, their range) and its
    # exact coverage; empty in a re-measure stored before they were
    p50_ratio_interval: list[float] = Field(default_factory=list)
    throughput_ratio_interval: list[float] = Field(default_factory=list)
    ratio_coverage: float | None = None
    flagged_rounds: int
    isa_cap: str | None = None  # the instruction set this variant's runtime was held to in this run (None: not capped)
    # interleaved: in one process with the reference; alternating: a fresh process per round, taking turns with the
    # reference (a runtime in an environment of its own), its figures scaled to the interleaved reference's
    method: Literal["interleaved", "alternating"] = "interleaved"


class Duel(Contract):
    """Two variants on one speed figure, taking turns block by block in one process (``bench.duel``), each opened as
    served (no spinning threads), a block's first calls after a switch not counted: a block is a tenth of a second or so
    of counted calls, so the machine's drift between the two is that, not the seconds between two rounds of the
    interleaved re-measure."""

    a: str
    b: str
    what: Literal["p50_ms", "throughput_ips"]
    pairs: int  # blocks of each, taken in turns
    time_ratio: float  # median over pairs of a's time per call / b's (below 1: a is faster)
    time_ratio_interval: list[float]  # the median's distribution-free interval (z of the job: wider than 95 % for several looks)
    verdict: Literal["a", "b", "tie", "undecided"]  # ahead beyond noise by at least the job's gap; within it; can't tell


class Duels(Contract):
    """The result of a ``DuelJob``: every pair of its variants on every figure asked."""

    duels: list[Duel]
    seconds: float
    environment: Environment | None = None
    phases: list[Phase] = Field(default_factory=list)


class Interleaved(Contract):
    reference: str
    rounds: int
    order: list[str]
    variants: dict[str, SideBySide]
    failed: dict[str, str] = Field(default_factory=dict)  # variants that could not even open here (e.g. bf16 under an AVX2 cap)
    environment: Environment | None = None
    phases: list[Phase] = Field(default_factory=list)
    cache_key: str | None = None
    # the close calls the rounds left, settled block by block (``Sweep.settle_ties``); their verdicts replace the
    # rounds' for the pairs and figures they cover
    duels: list[Duel] = Field(default_factory=list)
    # how many duel jobs ``Sweep.settle_ties`` ran on these rounds: a resumed run goes on from there, and measures
    # nothing more once the first reached its bound (its last duel may have left the new pick with close calls)
    settle_rounds: int = 0

    def duel(self, what: str, a: str, b: str) -> Duel | None:
        """The duel of ``a`` and ``b`` on ``what``, either way round."""
        return next((d for d in self.duels if d.what == what and {d.a, d.b} == {a, b}), None)

    def rounds_ratio(self, what: str, a: str, b: str) -> float | None:
        """The rounds' median of ``a``'s time per call over ``b``'s on ``what`` (a duel's ``time_ratio``), round by round."""
        va, vb = self.variants.get(a), self.variants.get(b)
        if va is None or vb is None:
            return None
        pairs = (list(zip(va.p50_ms_rounds, vb.p50_ms_rounds, strict=False)) if what == "p50_ms"
                 else [(y, x) for x, y in zip(va.throughput_rounds, vb.throughput_rounds, strict=False)])
        ratios = sorted(x / y for x, y in pairs if x and y)
        if not ratios:
            return None
        mid = len(ratios) // 2
        return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2

    def duel_disagrees(self, duel: Duel) -> float | None:
        """The rounds' median ratio of the duel's pair where the duel's interval excludes it, else None."""
        ratio = self.rounds_ratio(duel.what, duel.a, duel.b)
        lo, hi = sorted(duel.time_ratio_interval)
        return ratio if ratio is not None and not lo <= ratio <= hi else None

    def covers(self, names: list[str], figures: list[str]) -> bool:
        """Whether every pair of ``names`` has had its duel on every one of ``figures``."""
        return all(self.duel(f, a, b) for f in figures for i, a in enumerate(names) for b in names[i + 1:])

    def with_duels(self, new: list[Duel]) -> Interleaved:
        """These figures with ``new`` duels, which replace any earlier one of the same pair and figure."""
        kept = [d for d in self.duels if not any(x.what == d.what and {x.a, x.b} == {d.a, d.b} for x in new)]
        return self.model_copy(update={"duels": [*kept, *new]})


class BudgetStage(Contract):
    """One stage of a sweep under a time budget: what the plan gave it, what it used, what it left out for the time."""

    stage: str
    planned_s: float
    used_s: float | None = None  # None: it did not run
    skipped: list[str] = Field(default_factory=list)


class BudgetPlan(Contract):
    """How a sweep planned its ``--budget`` from this run's own costs (the baseline's batch call, a side-by-side turn),
    stage by stage, and what each stage used (``optimize.budget.Budget``)."""

    seconds: float
    label: str = ""
    batch_call_s: float  # one batch call of the baseline on all cores: what the finish's reserves are sized from
    remeasure_turn_s: float  # one candidate's turn in a side-by-side round
    stages: list[BudgetStage]


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
    meets: bool  # valid, no errors, and the SLO's percentile claimed within the bound (LoadGen's early-stopping rule)
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
