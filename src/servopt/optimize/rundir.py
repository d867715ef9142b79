"""A run directory of ``servopt optimize``: its typed files, and the one place that reads them back.

Kept free of heavy imports: the server reads run directories too. Run
directories written by servopt 0.1 (``servopt.result/1`` records and
``servopt.summary/1``) are read through ``results.migrate_v1``.

    config.json            RunConfig: the settings of the run
    data/eval.npz          evaluation inputs + labels
    reference_outputs.npy  the original model's outputs on eval.npz
    artifacts/<pass>-<hash>/   built models, cached by content hash of (source, pass chain, parameters)
    work/<variant>/<job>/  each job's job.json, job.log and replay.sh
    results.jsonl          one Record per variant, appended atomically (append-only)
    race.jsonl             a racing sweep's additions per record key: its cold start, what screened it out, a pick's axes
    interleave.json        the side-by-side re-measure of the top candidates with the reference
    profiles/<variant>.json    op-level profiles of the recommended variants
    summary.json, report.md, report.html

A distributed sweep (``--ray``) measures each variant once per kind of node (``Record.measured_for``): its jobs in
``work/<variant>/<kind>/``, the original's outputs in ``reference_outputs-<kind>.npy``, its re-measures in
``interleave-<kind>.json``, its profiles in ``profiles/<kind>/``, and ``work/ray-tasks.jsonl`` says on which node
and when every job ran.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field

from servopt.contracts import SUMMARY_SCHEMA, BudgetPlan, Contract, Environment, Interleaved, OpProfile, Record, Scaling
from servopt.errors import UserError
from servopt.optimize.decide import Decision
from servopt.optimize.targets import Target, kind_slug
from servopt.results import parse_record, read_jsonl
from servopt.spec import ModelSpec

M = TypeVar("M")


class RunDir:
    """Every path of a run directory, in one place (the layout is the module docstring's). Paths are absolute, so every
    record is readable from any working directory and every node of a cluster sees the same ones."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def eval_data(self) -> Path:
        return self.data / "eval.npz"

    def saved_data(self, name: str) -> Path:
        """A dataset the build processes read (``calib``, ``tune``)."""
        return self.data / f"{name}.npz"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def results(self) -> Path:
        return self.root / "results.jsonl"

    @property
    def race(self) -> Path:
        """What the race added to a record after its measurement (its cold start, or what screened it out), by key:
        results.jsonl keeps one line per measurement."""
        return self.root / "race.jsonl"

    def read_results(self) -> list[dict]:
        """results.jsonl's lines with what the race added to each (a torn last line of either is skipped)."""
        race: dict[str, dict] = {}
        for row in read_jsonl(self.race):  # rows for one key add up, later fields over earlier ones
            race.setdefault(row["key"], {}).update(row)
        return [{**r, **{k: v for k, v in race.get(r.get("key"), {}).items() if k != "key"}} for r in read_jsonl(self.results)]

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def work_root(self) -> Path:
        return self.root / "work"

    def work(self, variant: str, kind: str | None = None) -> Path:
        """A variant's job folders: ``work/<variant>/`` (one machine), ``work/<variant>/<kind>/`` per kind of node."""
        folder = self.work_root / variant
        return folder if kind is None else folder / kind_slug(kind)

    def reference_outputs(self, kind: str | None = None) -> Path:
        return self.root / ("reference_outputs.npy" if kind is None else f"reference_outputs-{kind_slug(kind)}.npy")

    def interleave(self, kind: str | None = None, isa: str | None = None) -> Path:
        return self.root / f"{self.interleave_label(kind, isa)}.json"

    @staticmethod
    def interleave_label(kind: str | None = None, isa: str | None = None) -> str:
        return "-".join(["interleave", *([kind_slug(kind)] if kind else []), *([str(isa)] if isa else [])])

    def scaling(self, kind: str | None = None) -> Path:
        return self.root / ("-".join(["scaling", *([kind_slug(kind)] if kind else [])]) + ".json")

    def capacity(self, target: str, variant: str) -> Path:
        return self.root / "capacity" / f"{target}-{variant}.json"

    def profile(self, variant: str, kind: str | None = None) -> Path:
        return self.root / "profiles" / (f"{variant}.json" if kind is None else f"{kind_slug(kind)}/{variant}.json")

    @property
    def compare(self) -> Path:
        """``servopt compare``'s result (``Comparison``); its builds and processes go under ``work/compare/``."""
        return self.root / "compare.json"


class LeftOut(Contract):
    name: str
    why: str


class RunConfig(Contract):
    model: str
    model_kind: str
    source_hash: str
    spec: ModelSpec
    targets: list[Target]
    variants: list[str]
    protocol: dict[str, Any]
    data: dict[str, Any]
    left_out: list[LeftOut] = Field(default_factory=list)
    note: str = ""
    measured_for: list[str | None] = Field(default_factory=lambda: [None])  # the kinds of node measured (None: one machine)


class KindSummary(Contract):
    """A distributed sweep's results for one kind of node: the targets decided on its records, the nodes that measured
    them, and its own re-measures and Pareto front (figures of different machines are never compared)."""

    kind: str
    ray_resources: dict[str, float]
    targets: list[str]
    nodes: list[str]
    interleaved: Interleaved | None = None
    capped: dict[str, Interleaved] = Field(default_factory=dict)
    pareto_front: list[str] = Field(default_factory=list)
    environment: Environment | None = None  # the machine of the kind's original (a node of that kind)
    scaling: Scaling | None = None  # its targets' candidates at 1, 2, … cores of a node of the kind


class Summary(Contract):
    schema_: str = Field(SUMMARY_SCHEMA, alias="schema")
    created: str
    run_dir: str
    reference: str | None
    reference_ort: str | None
    targets: list[Decision]
    pareto_front: list[str]
    interleaved: Interleaved | None = None
    capped: dict[str, Interleaved] = Field(default_factory=dict)  # per target ISA: re-measured with the ISA capped
    # the candidates of targets naming an instance, at 1, 2, … cores here: what their projections are fitted to
    scaling: Scaling | None = None
    counts: dict[str, int]
    environment: Environment | None = None
    kinds: list[KindSummary] = Field(default_factory=list)  # a distributed sweep: per kind of node (the fields above: kind None)
    # What went wrong on the way to the decisions without stopping them (a re-measure that failed, so the sweep's
    # figures decided), in words: shown in the report.
    problems: list[str] = Field(default_factory=list)
    racing: bool = False  # variants beaten beyond noise were screened out (their records say by what); False: --full
    not_tried: list[LeftOut] = Field(default_factory=list)  # chosen but not measured: the time budget, or not needed
    budget_s: float | None = None
    budget: BudgetPlan | None = None  # the time budget's plan, stage by stage, and what each stage used and skipped
    wall_s: float | None = None
    # Figures this run took from an earlier run into the same folder instead of measuring them (records, side-by-side
    # re-measures and their duels): their keys say the same variant, data, protocol, machine and library versions.
    reused: list[str] = Field(default_factory=list)
    # Stopped by SIGINT/SIGTERM: the decisions are the best answer from what was measured by then (no side-by-side
    # re-measure), what was not finished is in not_tried, and the same command resumes.
    interrupted: bool = False
    load_ips: float | None = None  # the load priced (instances and USD a month per target): --load

    def kind(self, kind: str | None) -> KindSummary | None:
        return next((k for k in self.kinds if k.kind == kind), None) if kind else None

    def decision(self, target: str) -> Decision | None:
        return next((d for d in self.targets if d.target.name == target), None)


def load_config(out: Path) -> RunConfig | None:
    path = RunDir(out).config
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    raw["left_out"] = raw.get("left_out") or []
    return RunConfig.model_validate({k: v for k, v in raw.items() if k in RunConfig.model_fields})


def load_run(out: Path) -> tuple[Summary | None, list[Record]]:
    """(summary, records) of an existing run directory: the latest record of each configured variant."""
    rd = RunDir(out)
    if not rd.results.exists():
        raise UserError(f"{out} is not a servopt run directory (no results.jsonl)", fix="run `servopt optimize … --out DIR` first")
    summary = _summary(json.loads(rd.summary.read_text()), out) if rd.summary.exists() else None
    # results.jsonl is append-only: a re-measured variant (changed settings) appears again. The run's view is the
    # latest record of each variant (and kind of node, on a distributed sweep) of the current configuration.
    latest = {(r["name"], r.get("measured_for")): r for r in rd.read_results()}
    config = load_config(out)
    names = config.variants if config else list(dict.fromkeys(n for n, _ in latest))
    kinds = config.measured_for if config else list(dict.fromkeys(k for _, k in latest))
    return summary, [parse_record(latest[(n, k)], out) for n in names for k in kinds if (n, k) in latest]


def load_profile(out: Path, variant: str, kind: str | None = None) -> OpProfile | None:
    path = RunDir(out).profile(variant, kind)
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    if "profiler" in raw and raw["profiler"].startswith("failed"):  # a version-1 failed profile
        raw = {"variant": variant, "profiler": "none", "total_ms_per_run": 0.0, "error": raw["profiler"]}
    return OpProfile.model_validate(raw)


def _summary(raw: dict, out: Path) -> Summary:
    if raw.get("schema") == SUMMARY_SCHEMA:
        return Summary.model_validate(raw)
    # Version 1: the same shape with dict records; the interleaved figures carried their protocol.
    for t in raw.get("targets", []):
        if t.get("result"):
            t["result"] = parse_record(t["result"], out).model_dump(by_alias=True)
        for v in [t.get("verdict"), *t.get("verdicts", [])]:
            if v:
                v.setdefault("notes", [])
    if raw.get("interleaved"):
        raw["interleaved"].pop("protocol", None)
    env = raw.get("environment")
    if env:
        raw["environment"] = {k: v for k, v in env.items() if k in Environment.model_fields}
    raw["schema"] = SUMMARY_SCHEMA
    return Summary.model_validate(raw)


def stored(path: Path, parse: Callable[[dict], M], keys: Collection[str]) -> M | None:
    """What a re-measure stored at ``path`` (a side-by-side run, an alternating one, the scaling, a capacity search), if
    it measured the same thing: its ``cache_key`` (what was measured: the variants' keys, the protocol, the rounds …)
    among ``keys``. The one way every stored re-measure is reused, so a resumed run measures nothing twice and a changed
    one measures again; a file it cannot read (torn, or from another servopt) is measured again, never trusted."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("cache_key") not in keys:
        return None
    try:
        return parse(data)
    except (ValueError, KeyError, TypeError):  # pydantic's ValidationError is a ValueError
        return None
