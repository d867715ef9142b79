"""Deployment targets: a named piece of hardware and the budget a variant must meet there.

Presets come from the serving tutorial; users add their own in YAML, validated
by pydantic so an error names the field. A target whose hardware is not this
machine is still judged, and every verdict says where its figures came from.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, ValidationError, model_validator

from servopt.cpu import Isa
from servopt.errors import UserError
from servopt.machine import Device

# Where a target's threads per core come from when it does not say: AWS EC2's CPU options default to 2 threads per core
# on its x86 instances (each vCPU one hyperthread of a core; ``ThreadsPerCore``: "A value of 1 disables multithreading
# for the instance. The default value is 2"), as GCP's and most Azure x86 sizes do: an even vCPU count is read so.
SMT_DEFAULT = ("2 for an even vCPU count (AWS EC2's x86 default, ThreadsPerCore 2: each vCPU a hyperthread of a core; GCP "
               "and most Azure x86 sizes alike), else 1; set 1 for an instance without SMT (AWS Graviton, SMT disabled)")


class Target(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    hardware: str = Field(description="the machine the budget is for, e.g. 'AMD EPYC 7763'")
    device: Device
    objective: Literal["throughput", "latency"] = "throughput"
    max_p50_ms: PositiveFloat | None = Field(None, description="median single-sample latency bound (the instance's, "
                                             "for a target naming instance_vcpus: projected there)")
    max_p99_ms: PositiveFloat | None = Field(
        None, description="the serving SLO: p99 of served requests (queueing, batching and HTTP included). With a price, "
                          "servopt optimize searches the pick's serving configuration for the most capacity within it, "
                          "and prices that capacity (servopt loadtest --slo)")
    min_throughput_ips: PositiveFloat | None = Field(None, description="batch throughput bound, samples/s")
    max_size_mb: PositiveFloat | None = Field(None, description="model size on disk bound")
    max_accuracy_drop: NonNegativeFloat = Field(1.0, description="accuracy points lost against the original, at most")
    min_cosine: float | None = Field(None, ge=-1, le=1, description="embeddings: mean cosine similarity to the original's, at least")
    max_spearman_drop: NonNegativeFloat | None = Field(
        None, description="embeddings with scored pairs: Spearman points lost against the original, at most")
    requests: Literal["tensors", "images"] = Field(
        "tensors", description="what this target's clients send the served model, and so what its capacity is "
                               "measured with: the preprocessed evaluation tensors (OIP v2 /infer), or an image "
                               "classifier's evaluation image files as they are (/classify: the server decodes and "
                               "preprocesses them). Text encoders are sent their evaluation texts either way")
    isa: Isa | None = Field(
        None, description="the target CPU's instruction set: its candidates are measured capped to it where a runtime allows")
    price_per_hour: PositiveFloat | None = Field(
        None, description="the hourly price of the instance this target stands for (USD): prices each variant per million "
                          "inferences and the instances a load needs")
    price_source: str | None = Field(None, description="where price_per_hour comes from, and when (shown beside every price)")
    instance_vcpus: PositiveInt | None = Field(
        None, description="that instance's vCPUs: its speed bounds are judged, and its price taken, on figures projected "
                          "from the cores measured here to this many (optimize.scaling), never on this machine's own")
    threads_per_core: Literal[1, 2] | None = Field(
        None, description="that instance's threads per physical core (SMT, hyperthreads): its vCPUs are instance_vcpus / "
                          "threads_per_core cores × this many threads, and the projection counts a second thread of a core "
                          f"as SMT adds, not as a core. Unset: {SMT_DEFAULT}")
    ray_resources: dict[str, PositiveFloat] | None = Field(
        None, description="a distributed sweep (--ray): the Ray resources of the nodes this target's candidates are "
                          "measured on, e.g. {'epyc-7763': 1} or {'GPU': 1}; ignored on one machine")

    @model_validator(mode="after")
    def _instance_layout(self) -> Target:
        if self.threads_per_core and self.instance_vcpus and self.instance_vcpus % self.threads_per_core:
            raise ValueError(f"instance_vcpus {self.instance_vcpus} is not a whole number of cores of "
                             f"{self.threads_per_core} threads: set threads_per_core to 1, or the vCPUs the instance has")
        return self

    @property
    def instance_threads(self) -> int:
        """Threads per physical core of the instance: stated, else ``SMT_DEFAULT``'s."""
        if self.threads_per_core is not None:
            return self.threads_per_core
        return 2 if self.instance_vcpus and self.instance_vcpus % 2 == 0 else 1

    @property
    def instance_cores(self) -> int | None:
        """The instance's physical cores: its vCPUs over its threads per core."""
        return self.instance_vcpus // self.instance_threads if self.instance_vcpus else None

    @property
    def layout_words(self) -> str:
        """"4 cores × 2 threads (…)": the instance as the projection reads it, and where its threads come from."""
        if not self.instance_vcpus:
            return ""
        why = "stated" if self.threads_per_core is not None else "the cloud default for an even vCPU count: set threads_per_core"
        return f"{self.instance_cores} cores × {self.instance_threads} thread{'s' if self.instance_threads > 1 else ''} ({why})"

    @property
    def kind(self) -> str | None:
        """The kind of node this target is measured on in a distributed sweep (``measurement_kind``)."""
        return measurement_kind(self.ray_resources)

    @property
    def names_instance(self) -> bool:
        """A CPU target naming its instance: its figures are projected from this machine's cores to the instance's."""
        return self.instance_vcpus is not None and self.device is Device.CPU

    @property
    def served(self) -> bool:
        """An instance target with a price and a serving SLO: its pick is served and its capacity searched."""
        return self.names_instance and self.price_per_hour is not None and self.max_p99_ms is not None


def measurement_kind(resources: dict[str, float] | None) -> str | None:
    """A stable label of a set of Ray resources: ``{"epyc-7763": 1}`` → ``epyc-7763``, ``{"GPU": 1, "a100": 1}`` →
    ``GPU+a100``, ``{"GPU": 0.5}`` → ``GPU=0.5``. None: no resources named (any node)."""
    if not resources:
        return None
    return "+".join(k if v == 1 else f"{k}={v:g}" for k, v in sorted(resources.items()))


def kind_slug(kind: str) -> str:
    """A kind label as a folder or file name."""
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", kind)


# Prices are list prices a user can check, with their source and date; no price list is fetched (servopt runs offline),
# so put your own (negotiated, reserved, spot) in a target YAML.
CPU_SERVER_PRICE = ("AWS EC2 c6a.2xlarge on-demand, us-east-1, Linux: 8 vCPUs (4 cores × 2 threads, AWS's default CPU options) "
                    "of AMD EPYC 7R13, the 7763's Zen 3 generation; "
                    "AWS's published rate, 2024 (check the current one)")
GPU_SERVER_PRICE = ("AWS EC2 p4d.24xlarge on-demand, us-east-1: 32.77 USD/h for 8 × A100 40 GB, per GPU; AWS's published "
                    "rate, 2024 (check the current one)")
PRESETS: dict[str, Target] = {
    "cpu-server": Target(name="cpu-server", hardware="AMD EPYC 7763", device="cpu", objective="throughput",
                         max_p50_ms=3.0, min_throughput_ips=1000, isa="avx2", price_per_hour=0.306, instance_vcpus=8,
                         max_p99_ms=50.0, price_source=CPU_SERVER_PRICE, threads_per_core=2),
    "gpu-server": Target(name="gpu-server", hardware="NVIDIA A100", device="gpu", objective="throughput",
                         max_p50_ms=1.0, min_throughput_ips=5000, price_per_hour=4.10, price_source=GPU_SERVER_PRICE),
    "edge": Target(name="edge", hardware="ARM Cortex-A76", device="edge", objective="latency",
                   max_size_mb=5.0, max_p50_ms=15.0),
}


def _format_error(e: ValidationError, where: str) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        parts.append(f"{where}{'.' if loc and not loc.startswith('[') else ''}{loc}: {err['msg']}")
    return "; ".join(parts)


def load_targets(spec: str) -> list[Target]:
    """``cpu-server,edge`` (presets), a YAML file, or both mixed: ``cpu-server,my.yaml``."""
    targets: list[Target] = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item in PRESETS:
            targets.append(PRESETS[item])
        elif item.endswith((".yaml", ".yml")):
            targets += _load_yaml(Path(item))
        else:
            raise UserError(f"unknown target {item!r}", fix=f"use a preset ({', '.join(PRESETS)}) or a .yaml file")
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise UserError(f"target names repeat: {names}", fix="give each target a distinct name")
    if not targets:
        raise UserError("no targets given", fix="e.g. --targets cpu-server,edge")
    return targets


def _load_yaml(path: Path) -> list[Target]:
    if not path.exists():
        raise UserError(f"target file {path} does not exist", fix="check the path")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {e}", fix="fix the syntax") from e
    items = raw.get("targets") if isinstance(raw, dict) else None
    if not isinstance(items, list):
        raise UserError(f"{path} must have a top-level 'targets:' list",
                        fix="targets:\n  - name: my-cpu\n    hardware: Xeon 8480\n    device: cpu\n    max_p50_ms: 5")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("preset"):
            base = PRESETS.get(item["preset"])
            if base is None:
                raise UserError(f"{path}: targets[{i}].preset: unknown preset {item['preset']!r}", fix=f"use one of {list(PRESETS)}")
            item = {**base.model_dump(), **{k: v for k, v in item.items() if k != "preset"}}
        try:
            out.append(Target(**item) if isinstance(item, dict) else Target.model_validate(item))
        except ValidationError as e:
            raise UserError(_format_error(e, f"{path}: targets[{i}]"), fix="see docs/targets.md for the fields") from e
    return out
