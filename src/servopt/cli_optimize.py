"""The ``optimize``, ``report``, ``profile`` and ``demo`` commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from servopt.cli import ArchOpt, ClassesOpt, DataOpt, ModelArg, ShapeOpt, SplitOpt, TrustOpt, app, console, run_cli
from servopt.errors import UserError

TargetsOpt = Annotated[str, typer.Option("--targets", help="presets (cpu-server, gpu-server, edge) and/or YAML files, comma-separated")]


def print_summary(summary: dict, records: list[dict]) -> None:
    from servopt.optimize.report import variant_rows, verdict_rows

    ref = next((r for r in records if r["name"] == summary.get("reference")), None)
    t = Table(title="every variant", title_style="bold")
    for col in ("variant", "status", "size MB", "accuracy", "Δ pts", "p50 ms", "p99 ms", "batch/s", "cold s", "notes"):
        t.add_column(col, justify="left" if col in ("variant", "status", "accuracy", "notes") else "right")
    for r in variant_rows(records, ref, summary.get("pareto_front", [])):
        status = {"ok": "[green]ok[/green]", "failed": "[red]failed[/red]", "skipped": "[yellow]skipped[/yellow]"}[r["status"]]
        note = escape(r["error"][:70]) if r["error"] else r["notes"]
        t.add_row(r["name"], status, r["size"], r["accuracy"], r["drop"], r["p50"], r["p99"], r["batch"], r["cold"], note)
    console.print(t)
    if summary.get("interleaved"):
        il = Table(title="same-run ratios vs ONNX Runtime defaults (interleaved)", title_style="bold")
        for col in ("variant", "p50 ms", "batch/s", "p50 ratio", "throughput ratio"):
            il.add_column(col, justify="left" if col == "variant" else "right")
        from servopt.optimize.report import interleave_rows

        for r in interleave_rows(summary):
            il.add_row(r["name"], r["p50"], r["tp"], r["p50_ratio"], r["tp_ratio"])
        console.print(il)
    v = Table(title="verdict per target", title_style="bold", show_lines=True)
    for col in ("target", "hardware", "status", "recommended", "why"):
        v.add_column(col)
    for r in verdict_rows(summary):
        colour = "green" if r["status"].startswith("pass") else "red" if r["status"] == "fail" else "yellow"
        v.add_row(r["name"], r["hardware"], f"[{colour}]{r['status']}[/{colour}]", r["recommended"], escape(r["reason"]))
    console.print(v)


def _progress_ui(quiet: bool):
    from servopt.optimize.runner import Progress as Callbacks

    if quiet:
        return None, Callbacks()
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)
    task = {}

    def start(total: int) -> None:
        task["id"] = bar.add_task("variants", total=total)

    return bar, Callbacks(
        start=start,
        step=lambda m: bar.update(task["id"], description=escape(m)) if "id" in task else None,
        advance=lambda: bar.advance(task["id"]),
        note=lambda m: bar.console.print(f"[dim]{escape(m)}[/dim]"),
    )


def run_optimize(loaded, data: Path | None, split: str | None, targets: str, out: Path, variants: list[str] | None,
                 include_all: bool, quiet: bool, json_out: bool, calibration_samples: int, limit: int | None,
                 note: str | None = None, quick: bool = False, resize: int | None = None, crop: int | None = None) -> dict:
    from servopt.bench.protocol import Protocol
    from servopt.cli_common import open_data
    from servopt.data.dataset import FOOD11_SPLITS, synthetic_inputs
    from servopt.optimize.rundir import load_run
    from servopt.optimize.runner import OptimizeConfig, optimize
    from servopt.optimize.targets import load_targets

    cfg = OptimizeConfig(out=out, targets=load_targets(targets), variants=variants, include_all=include_all, note=note or "")
    if quick:
        cfg.protocol, cfg.interleave_protocol, cfg.interleave_rounds = Protocol.quick(), Protocol.quick(), 2
    eval_data = open_data(loaded, data, split or ("evaluation" if data and (data / "evaluation").is_dir() else None), limit=limit,
                          resize=resize, crop=crop)
    if data is None:
        tune = synthetic_inputs(loaded.spec, count=128, seed=7)
        if not quiet:
            console.print("[yellow]no --data: inputs made from the model's signature; only agreement with the original is measured[/yellow]")
    else:
        tune_split = "validation" if (data / "validation").is_dir() else None
        if tune_split is None and not quiet:
            console.print("[yellow]no validation/ split: calibration and tuning use the same images as evaluation[/yellow]")
        tune = open_data(loaded, data, tune_split if any((data / s).is_dir() for s in FOOD11_SPLITS) else None, limit=500,
                         resize=resize, crop=crop)
    step = max(1, len(tune) // calibration_samples)
    calib = tune.subset(np.arange(0, len(tune), step)[:calibration_samples])  # spread over the split
    bar, callbacks = _progress_ui(quiet or json_out)
    if bar:
        with bar:
            summary = optimize(loaded, eval_data, calib, tune, cfg, callbacks)
    else:
        summary = optimize(loaded, eval_data, calib, tune, cfg, callbacks)
    if json_out:
        print(json.dumps(summary, default=str))
    elif not quiet:
        print_summary(summary, load_run(out)[1])
        console.print(f"report: {out / 'report.html'} (and report.md, summary.json)")
    return summary


@app.command()
def optimize(
    model: ModelArg,
    arch: ArchOpt = None,
    num_classes: ClassesOpt = None,
    trust_pickle: TrustOpt = False,
    input_shape: ShapeOpt = None,
    data: DataOpt = None,
    split: SplitOpt = None,
    targets: TargetsOpt = "cpu-server,gpu-server,edge",
    out: Annotated[Path, typer.Option(help="run directory (rerun the same command to resume)")] = Path("runs/optimize"),
    variants: Annotated[list[str] | None, typer.Option("--variants", help="only these variants (names, globs or groups)")] = None,
    include_all: Annotated[bool, typer.Option(help="also the variants left out of the default sweep")] = False,
    calibration_samples: Annotated[int, typer.Option(help="calibration samples from the validation split")] = 100,
    limit: Annotated[int | None, typer.Option(help="evaluate on at most this many images")] = None,
    resize: Annotated[int | None, typer.Option(help="shorter side after resize (default 224)")] = None,
    crop: Annotated[int | None, typer.Option(help="center-crop size (default 224)")] = None,
    quick: Annotated[bool, typer.Option(help="a smoke run: tiny timing phases, figures not for decisions")] = False,
    quiet: Annotated[bool, typer.Option(help="no progress, no tables")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print summary.json to stdout")] = False,
) -> None:
    """Build every variant, verify it, benchmark it, and pick the best per deployment target."""

    def go() -> None:
        from servopt.cli_common import open_model

        run_optimize(open_model(model, arch, num_classes, trust_pickle, input_shape), data, split, targets, out, variants,
                     include_all, quiet, json_out, calibration_samples, limit, quick=quick, resize=resize, crop=crop)

    run_cli(go)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run directory of servopt optimize")]) -> None:
    """Re-render report.html and report.md from the stored results (no re-measuring)."""

    def go() -> None:
        from servopt.optimize.report import write_reports
        from servopt.optimize.rundir import load_run

        summary, records = load_run(run_dir)
        if not summary:
            raise UserError(f"{run_dir} has results but no summary.json (the run did not finish)", fix="rerun the optimize command")
        write_reports(run_dir, summary, records)
        print_summary(summary, records)
        console.print(f"report: {run_dir / 'report.html'}")

    run_cli(go)


@app.command()
def profile(
    run_dir: Annotated[Path, typer.Argument(help="a run directory of servopt optimize")],
    variant: Annotated[str, typer.Option(help="the variant to profile")],
    runs: Annotated[int, typer.Option(help="single-sample runs to profile")] = 30,
    top: Annotated[int, typer.Option(help="how many operators to list")] = 15,
) -> None:
    """Where the time goes, op by op (ONNX Runtime profiler, OpenVINO counters or torch.profiler)."""

    def go() -> None:
        from servopt.optimize.profile import profile_record
        from servopt.optimize.rundir import load_run

        _, records = load_run(run_dir)
        rec = next((r for r in records if r["name"] == variant), None)
        if rec is None:
            raise UserError(f"no variant {variant!r} in {run_dir}", fix=f"one of: {', '.join(r['name'] for r in records)}")
        prof = profile_record(rec, run_dir, runs=runs, top=top)
        t = Table(title=f"{variant}: {prof['profiler']}, {prof['total_ms_per_run']:.2f} ms of kernels per sample", title_style="bold")
        for col in ("op", "ms/sample", "share", "calls/sample"):
            t.add_column(col, justify="left" if col == "op" else "right")
        for o in prof["ops"]:
            t.add_row(o["op"], f"{o['ms_per_run']:.3f}", f"{o['share']:.1%}", f"{o['calls_per_run']:.0f}")
        console.print(t)

    run_cli(go)


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="run directory")] = Path("runs/demo"),
    targets: TargetsOpt = "cpu-server,gpu-server,edge",
    variants: Annotated[list[str] | None, typer.Option("--variants", help="only these variants")] = None,
    include_all: Annotated[bool, typer.Option(help="also the variants left out of the default sweep")] = False,
    quiet: Annotated[bool, typer.Option(help="no progress, no tables")] = False,
) -> None:
    """The built-in demo: a MobileNetV2 trained (once) on the digits stand-in for Food-11, optimized for three targets."""

    def go() -> None:
        from servopt.demo import ensure_demo
        from servopt.models.sources import load_model

        data_root, weights, training = ensure_demo(log=console.print)
        note = ("demo: MobileNetV2 trained on scikit-learn's handwritten digits, standing in for Food-11 "
                f"(no download possible here); validation top-1 {training['validation_top1']:.2%}")
        if not quiet:
            console.print(note)
        run_optimize(load_model(weights, arch="mobilenet_v2"), data_root, "evaluation", targets, out, variants, include_all,
                     quiet, False, 100, None, note=note)

    run_cli(go)
