"""The report's header and closing lines: the model, the run directory, when, the run's note, the batch size its
figures are for, the problems it met, and the environment it measured in."""

from __future__ import annotations

from pathlib import Path

from servopt.contracts import OpProfile
from servopt.optimize.rundir import load_profile
from servopt.report.sections import ReportInput, section


@section("model")
def _model(r: ReportInput) -> str:
    return Path(r.config.model).name if r.config else "?"


@section("run_dir")
def _run_dir(r: ReportInput) -> str:
    return str(r.out)


@section("created")
def _created(r: ReportInput) -> str:
    return r.summary.created


@section("note")
def _note(r: ReportInput) -> str:
    return r.config.note if r.config else ""


@section("batch")
def _batch(r: ReportInput) -> int | str:
    return (r.config.protocol.get("batch_size") if r.config else None) or next((x.batch_size for x in r.records if x.batch_size), "?")


@section("problems")
def _problems(r: ReportInput) -> list[str]:
    return r.summary.problems


@section("environment")
def _environment(r: ReportInput) -> str:
    return r.summary.environment.model_dump_json(indent=2) if r.summary.environment else "{}"


@section("profiles")
def _profiles(r: ReportInput) -> list[OpProfile]:
    """Where each pick's time goes, op by op (its profile job's result)."""
    out = []
    for name, kind in r.picked:
        prof = load_profile(r.out, name, kind)
        if prof is not None:
            out.append(prof.model_copy(update={"variant": f"{name} [{kind}]" if kind else name}))
    return out
