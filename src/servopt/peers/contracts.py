"""What ``servopt compare`` writes (``compare.json``): a peer's same-run ratios to servopt's pick, the peer's result,
and the comparison; read by the report's comparison section."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from servopt.contracts import AnyQuality, Artifact, Contract, Environment, SessionInfo, parse_quality

COMPARE_SCHEMA = "servopt.compare/1"


class PeerRatio(Contract):
    """A peer's figure against servopt's pick, same run: the median of the per-round ratios (peer ÷ pick, each round's
    two processes minutes apart at most) and the median's distribution-free interval over the rounds (binomial order
    statistics: one disturbed round moves it by a rank, not by its size). ``confidence`` is that interval's exact
    coverage: with 3 rounds it is the range of the ratios and covers the true median ratio 75 % of the time."""

    metric: str  # the scenario's figure: p50_ms, throughput_ips
    scenario: str
    label: str = ""  # the scenario's own words for the figure, its column heading (an older compare.json: none)
    better: Literal["lower", "higher"]
    ratio: float
    low: float
    high: float
    confidence: float
    rounds: list[float]  # each round's ratio
    pick_median: float
    peer_median: float


class PeerResult(Contract):
    """One peer in a comparison: what it built and what ran, its quality against the original, and its same-run ratios
    to servopt's pick; or why it could not take part (``unavailable``: cannot install or run here; ``failed``: it
    tried and broke)."""

    name: str
    status: Literal["ok", "unavailable", "failed"]
    why: str | None = None
    description: str = ""
    configuration: dict[str, Any] = Field(default_factory=dict)  # the tool, its version and the call it was given
    artifact: Artifact | None = None
    runtime: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    build_s: float | None = None
    reused_build: bool = False  # built by an earlier comparison from the same inputs (the peer's source, environment, files)
    size_mb: float | None = None
    quality: AnyQuality | None = None
    quality_text: str = ""  # the family's words for it
    quality_drop: float | None = None  # the family's drop against the original (points of top-1, …)
    ratios: list[PeerRatio] = Field(default_factory=list)
    flagged_rounds: int = 0  # rounds where its measuring process saw other processes use the CPU
    session: SessionInfo | None = None  # what actually ran (provider, precision, threads), read back

    _quality = field_validator("quality", mode="before")(parse_quality)


class Comparison(Contract):
    """``servopt compare``: the run's pick for one target and the answers of the tools a user would use instead, each
    measured in a fresh process per round, the order flipped every round (``compare.json``)."""

    schema_: str = Field(COMPARE_SCHEMA, alias="schema")
    created: str
    run_dir: str
    target: str
    pick: str
    pick_note: str = ""  # e.g. no variant met the target's bounds: the nearest miss is compared
    pick_quality_text: str = ""
    pick_quality_drop: float | None = None
    pick_session: SessionInfo | None = None
    scenarios: list[str]
    rounds: int
    order: list[list[str]]  # the order each round ran in
    noisy_rounds: list[int] = Field(default_factory=list)  # rounds where some process saw other processes use the CPU
    quick: bool = False
    peers: list[PeerResult]
    environment: Environment | None = None
