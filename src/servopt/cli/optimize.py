"""The ``optimize``, ``report``, ``profile`` and ``demo`` commands."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
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

from servopt.cli.app import (
    ArchOpt,
    ClassesOpt,
    ModelArg,
    OutputOpt,
    ShapeOpt,
    TrustOpt,
    app,
    console,
    run_cli,
)
from servopt.cli.common import with_data_flags
from servopt.errors import UserError
from servopt.settings import DEFAULT_BUDGET

TargetsOpt = Annotated[str | None, typer.Option("--targets", help="presets (cpu-server, gpu-server, edge) and/or YAML files, "
                                                                  "comma-separated [default: cpu-server,gpu-server,edge]")]
OutOpt = Annotated[Path | None, typer.Option("--out", help="run directory (rerun the same command to resume) [default: runs/optimize]")]
VariantsOpt = Annotated[list[str] | None, typer.Option("--variants", help="only these variants (names, globs or groups)")]
IncludeAllOpt = Annotated[bool, typer.Option("--include-all", help="also the variants left out of the default sweep")]
QuietOpt = Annotated[bool, typer.Option("--quiet", help="no progress, no tables")]
FullOpt = Annotated[bool, typer.Option("--full", help="no race: build, measure and cold-start every variant (slower; the same "
                                                             "decisions, every variant's figures complete)")]
LabOpt = Annotated[bool, typer.Option("--lab", help="also the lab's ladder (text: plain / eval / no_grad / torch.compile)")]
BudgetOpt = Annotated[str | None, typer.Option("--budget", help=f"a time budget for the whole sweep (300, 5m, 1h) [default: "
                                                                f"{DEFAULT_BUDGET}; none: no limit; --full: none]: the likeliest "
                                                                "winners first, a build still running at its end stopped; what "
                                                                "it did not try is listed")]
# The demo answers in five minutes (issue 18): the likely winners first, what it did not try listed; --full or
# --budget none for everything.
DEMO_BUDGET = "5m"
DemoBudgetOpt = Annotated[str | None, typer.Option("--budget", help=f"a time budget for the whole sweep [default: {DEMO_BUDGET}; "
                                                                   "none: no limit; --full: none]: the likeliest winners "
                                                                   "first; what it did not try is listed")]
LoadOpt = Annotated[str | None, typer.Option("--load", help="a load to price, e.g. 500/s or 30000/min: the instances and USD a "
                                                            "month each target's pick needs (targets with price_per_hour)")]
NoCapacityOpt = Annotated[bool, typer.Option(
    "--no-capacity", help="do not serve the priced targets' picks to search their capacity within the SLO (max_p99_ms): "
                          "prices and throughput bounds then use the offline figures, projected to the instance")]
RayOpt = Annotated[str | None, typer.Option(
    "--ray", help="a distributed sweep on a Ray cluster: auto, ray://HOST:10001, HOST:6379, or local (Ray started here); "
                  "the run directory must be visible from every node (docs/ray.md; needs the servopt\\[ray] extra)")]


def print_summary(summary, records) -> None:
    from servopt.families import family_of
    from servopt.optimize.rundir import load_config
    from servopt.report.prices import price_section
    from servopt.report.race import race_section
    from servopt.report.remeasure import interleave_rows
    from servopt.report.sections import pareto_marks, references_by_kind
    from servopt.report.variants import variant_rows
    from servopt.report.verdicts import verdict_rows

    if summary.interrupted:
        console.print("[bold yellow]INTERRUPTED: the best answer from what was measured before the stop; rerun the same "
                      "command to finish (not finished: "
                      f"{escape(', '.join(v.name for v in summary.not_tried if v.why.startswith('not finished')) or 'none')})"
                      "[/bold yellow]")
    ref = next((r for r in records if r.name == summary.reference), None)
    config = load_config(Path(summary.run_dir))
    family = family_of(config.spec) if config else None
    t = Table(title="every variant", title_style="bold")
    batch = f"batch-{next((r.batch_size for r in records if r.batch_size), '?')}/s"  # the batch the run measured at
    for col in ("variant", "status", "size MB", "quality", "Δ pts", "precision", "p50 ms", "p99 ms", batch, "cold s", "notes"):
        t.add_column(col, justify="left" if col in ("variant", "status", "quality", "precision", "notes") else "right")
    rows = variant_rows(records, ref, pareto_marks(summary), family, references_by_kind(records, summary.reference)) if family else []
    for r in rows:
        status = {"ok": "[green]ok[/green]", "failed": "[red]failed[/red]", "skipped": "[yellow]skipped[/yellow]"}[r.status]
        note = escape(r.error[:70]) if r.error else r.notes
        t.add_row(escape(r.name), status, r.size, r.accuracy, r.drop, r.precision, r.p50, r.p99, r.batch, r.cold, note)
    console.print(t)
    for kind, interleaved in [(None, summary.interleaved), *((k.kind, k.interleaved) for k in summary.kinds)]:
        if interleaved is None:
            continue
        where = f", measured for {kind}" if kind else ""
        il = Table(title=f"same-run ratios vs ONNX Runtime defaults (interleaved{where})", title_style="bold")
        for col in ("variant", "p50 ms", batch, "p50 ratio", "throughput ratio"):
            il.add_column(col, justify="left" if col == "variant" else "right")
        for row in interleave_rows(interleaved):
            il.add_row(row.name, row.p50, row.tp, row.p50_ratio, row.tp_ratio)
        console.print(il)
    v = Table(title="verdict per target", title_style="bold", show_lines=True)
    for col in ("target", "hardware", "status", "recommended", "why"):
        v.add_column(col)
    for row in verdict_rows(summary):
        colour = "green" if row.status.startswith("pass") else "red" if row.status.startswith("fail") else "yellow"
        v.add_row(row.name, row.hardware, f"[{colour}]{row.status}[/{colour}]", row.recommended, escape(row.reason))
    console.print(v)
    prices = price_section(summary)
    if prices:
        p = Table(title=f"what it costs, USD per million inferences (load: {prices.load})", title_style="bold")
        for col in ("target", "variant", "instance capacity priced", "per million", "instances", "USD/month"):
            p.add_column(col, justify="left" if col in ("target", "variant", "instance capacity priced") else "right")
        for r in prices.rows:
            p.add_row(r.target, f"[bold]{escape(r.variant)}[/bold]" if r.pick else escape(r.variant), r.capacity, r.per_million,
                      r.instances, r.monthly)
        console.print(p)
        for n in prices.notes:
            console.print(f"[dim]{escape(n)}[/dim]")
    race = race_section(summary, records)
    if race:
        console.print(f"[dim]{escape(race.summary)} Screened out: {', '.join(n for n, _ in race.screened) or 'none'}; not tried: "
                      f"{', '.join(v.name for v in race.not_tried) or 'none'} (report.html says why).[/dim]")
    for problem in summary.problems:
        console.print(f"[yellow]{escape(problem)}[/yellow]")


def result_line(record, family) -> str:
    """A variant's record in one plain line: its status, quality and p50 (or why it has none)."""
    if record.status != "ok":
        return f"{record.name}: {record.status}: {record.error or ''}".rstrip(": ")
    p50 = f"{record.latency_ms.p50:.3g} ms" if record.latency_ms else "—"
    quality = family.describe_quality(record) if family is not None else "—"
    return f"{record.name}: ok, quality {quality}, p50 {p50}"


class _BudgetRemaining(TimeRemainingColumn):
    """rich's estimate of the time left, never past the time budget's end: the sweep stops there (what it did not try
    is listed), so an estimate from the pace of the first variants (a 1-minute budget said 8 minutes) misleads.
    ``left``: the sweep's own reading of its budget (``Budget.left``; None: no budget), set once the sweep exists."""

    def __init__(self) -> None:
        super().__init__()
        self.left: Callable[[], float | None] = lambda: None

    def render(self, task):
        from rich.text import Text

        shown = super().render(task)
        budget_left = self.left()
        if budget_left is None or task.finished:
            return shown
        left = max(0, int(budget_left))
        estimate = task.time_remaining
        if estimate is not None and estimate <= left:
            return shown
        return Text(f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d} (budget)", style="progress.remaining")


def _progress_ui(quiet: bool, family=None):
    """The sweep's progress: a rich bar on a terminal; one plain line per step and per result when the output goes to a
    file or pipe (a log shows what the run did, as it did it); nothing with --quiet."""
    import time

    from servopt.optimize.sweep import Progress as Callbacks

    if quiet:
        return None, Callbacks()
    if not console.is_terminal:
        began = time.monotonic()

        def say(message: str) -> None:
            elapsed = int(time.monotonic() - began)
            console.print(f"[{elapsed // 60:02d}:{elapsed % 60:02d}] {message}", markup=False, highlight=False, soft_wrap=True)

        return None, Callbacks(start=lambda total: say(f"{total} variants to build and measure"), step=say, note=say,
                               result=lambda rec: say(result_line(rec, family)))
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("ETA"), _BudgetRemaining(), console=console, transient=False)
    task: dict[str, int] = {}
    early = [0]  # advances before the bar has its total (a resumed run's cached records): counted when it starts

    def start(total: int) -> None:
        task["id"] = bar.add_task("variants", total=total, completed=early[0])

    def advance() -> None:
        if "id" in task:
            bar.advance(task["id"])
        else:
            early[0] += 1

    return bar, Callbacks(
        start=start,
        step=lambda m: bar.update(task["id"], description=escape(m)) if "id" in task else None,
        advance=advance,
        note=lambda m: bar.console.print(f"[dim]{escape(m)}[/dim]"),
        result=lambda rec: bar.console.print(f"[dim]{escape(result_line(rec, family))}[/dim]"),
    )


@contextmanager
def stopping_on_signals(executor):
    """SIGINT/SIGTERM during a sweep: every job under way is killed with its process group (``launcher.stop_all``),
    the executor starts nothing more, and the sweep writes summary.json and the reports with the best answer so far,
    marked interrupted (``Sweep.run``). A second signal quits at once. Yields the signals received."""
    import signal
    import threading

    from servopt.bench.launcher import reset_stop, stop_all

    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum: int, _frame) -> None:
        if got:
            raise KeyboardInterrupt
        got.append(signum)
        stopped = stop_all()
        executor.stop()
        console.print(f"[yellow]{signal.Signals(signum).name}: stopped {stopped} job(s) under way; writing what was found so far "
                      "(again to quit at once)[/yellow]")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for sig, was in previous.items():
            signal.signal(sig, was)
        reset_stop()


def capacity_probe():
    """How the sweep serves a priced target's pick and searches its capacity within the SLO (``serve.capacity``):
    None where the serving extra is not installed (prices then come from the offline figures, and say so)."""
    try:
        from servopt.serve.capacity import probe
    except ImportError:
        return None
    return probe


def run_optimize(loaded, data_raw: dict, settings, quiet: bool, json_out: bool) -> object:
    """Read the data through the model's family, then run the sweep (``optimize.sweep``) with progress bars."""

    from servopt.cli.common import data_options
    from servopt.export import verify_against_weights
    from servopt.optimize import sweep
    from servopt.optimize.rundir import load_run
    from servopt.optimize.targets import load_targets
    from servopt.report.data import torch_weights_line

    targets = load_targets(settings.targets)
    family, options = data_options(loaded, **data_raw)
    eval_data, loaded.spec = family.read_eval(loaded.spec, options)
    tune, notes = family.read_tuning(loaded.spec, options)
    checked = verify_against_weights(loaded, eval_data)  # an ONNX encoder beside its PyTorch weights: the report says
    if checked is not None:
        eval_data.meta["torch_weights"] = checked
        if not checked.get("within_tolerance"):
            notes.append(torch_weights_line(checked))
    if not quiet and not json_out:
        if not family.has_data(options):
            console.print(f"[yellow]{family.no_data_note}[/yellow]")
        for n in notes:
            console.print(f"[yellow]{escape(n)}[/yellow]")
    count = settings.calibration_samples
    calib = tune.subset(np.arange(0, len(tune), max(1, len(tune) // count))[:count])  # spread over the split
    bar, callbacks = _progress_ui(quiet or json_out, family)
    with sweep.open_executor(settings.ray) as executor, stopping_on_signals(executor) as signals:
        # --ray: a Ray cluster's nodes; else this machine, Ray never imported
        run = sweep.Sweep(model=loaded, eval_data=eval_data, calibration=calib, tuning=tune, settings=settings, targets=targets,
                          executor=executor, progress=callbacks,
                          capacity_probe=None if settings.no_capacity else capacity_probe())
        if bar:
            for column in bar.columns:  # the bar's time left reads the sweep's own budget clock
                if isinstance(column, _BudgetRemaining):
                    column.left = lambda: run.budget.left(closing=False)
            with bar:
                summary = run.run()
        else:
            summary = run.run()
    from servopt.report import write_reports

    write_reports(run.out)  # only commands render: the sweep returns its results (an interrupted run's too)
    if json_out:
        print(summary.model_dump_json(by_alias=True))
    elif not quiet:
        print_summary(summary, load_run(run.out)[1])
        console.print(f"report: {run.out / 'report.html'} (and report.md, summary.json)")
    if signals:  # the usual exit status of a process ended by that signal (130 for SIGINT, 143 for SIGTERM)
        raise typer.Exit(128 + signals[0])
    return summary


def optimize_settings(**given):
    """Settings from the command line over ``SERVOPT_OPTIMIZE_*`` variables over the defaults; ``--full`` without
    ``--budget`` lifts the default budget (everything, however long). A distributed sweep (``--ray``) without Ray
    installed fails here, before any model or data is read."""
    from pydantic import ValidationError

    from servopt.settings import OptimizeSettings

    if given.get("full") and given.get("budget") is None:
        given = {**given, "budget": "none"}

    try:
        settings = OptimizeSettings(**{k: v for k, v in given.items() if v is not None and v is not False})
    except ValidationError as e:
        first = e.errors()[0]
        raise UserError(f"--{first['loc'][0]}: {first['msg'].removeprefix('Value error, ')}", fix="see --help") from e
    if settings.ray:
        from servopt.optimize.ray_executor import import_ray

        import_ray()
    return settings


@app.command()
@with_data_flags
def optimize(
    model: ModelArg,
    data: dict,
    arch: ArchOpt = None,
    num_classes: ClassesOpt = None,
    trust_pickle: TrustOpt = False,
    input_shape: ShapeOpt = None,
    output: OutputOpt = None,
    targets: TargetsOpt = None,
    out: OutOpt = None,
    variants: VariantsOpt = None,
    include_all: IncludeAllOpt = False,
    calibration_samples: Annotated[int | None, typer.Option(help="calibration samples from the tuning split [default: 100]")] = None,
    quick: Annotated[bool, typer.Option(help="a smoke run: tiny timing phases, figures not for decisions")] = False,
    full: FullOpt = False,
    lab: LabOpt = False,
    budget: BudgetOpt = None,
    load: LoadOpt = None,
    ray: RayOpt = None,
    quiet: QuietOpt = False,
    json_out: Annotated[bool, typer.Option("--json", help="print summary.json to stdout")] = False,
    no_capacity: NoCapacityOpt = False,
) -> None:
    """Build every variant, verify it, benchmark it, and pick the best per deployment target."""

    def go() -> None:
        from servopt.cli.common import open_model

        settings = optimize_settings(targets=targets, out=out, variants=variants, include_all=include_all,
                                     calibration_samples=calibration_samples, quick=quick, ray=ray, full=full, lab=lab,
                                     budget=budget, load=load, no_capacity=no_capacity)
        run_optimize(open_model(model, arch, num_classes, trust_pickle, input_shape, output), data, settings, quiet, json_out)

    run_cli(go)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run directory of servopt optimize")]) -> None:
    """Re-render report.html and report.md from the stored results (reads only: nothing is measured)."""

    def go() -> None:
        from servopt.optimize.rundir import load_run
        from servopt.report import write_reports

        write_reports(run_dir)
        summary, records = load_run(run_dir)
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
    """Where the time goes, op by op (ONNX Runtime profiler, OpenVINO counters or torch.profiler), in a fresh process."""

    def go() -> None:
        from servopt.bench.jobs import OpenSpec, ProfileJob
        from servopt.bench.launcher import launch
        from servopt.optimize.rundir import load_run

        _, records = load_run(run_dir)
        rec = next((r for r in records if r.name == variant), None)
        if rec is None:
            raise UserError(f"no variant {variant!r} in {run_dir}", fix=f"one of: {', '.join(r.name for r in records)}")
        if rec.status != "ok" or rec.artifact is None:
            raise UserError(f"variant {variant} did not run ({rec.error})", fix="profile a variant that ran")
        job = ProfileJob(session=OpenSpec.of(rec),
                         data=str(Path(run_dir).resolve() / "data" / "eval.npz"), runs=runs, top=top, env=rec.env)
        launched = launch(job, Path(run_dir).resolve() / "work" / variant / "profile-cli")
        if launched.result is None:
            raise UserError(f"profiling {variant} failed: {launched.error}", fix=f"replay it alone: {launched.failure.replay}")  # type: ignore[union-attr]
        prof = launched.result
        t = Table(title=f"{variant}: {prof.profiler}, {prof.total_ms_per_run:.2f} ms of kernels per sample", title_style="bold")
        for col in ("op", "ms/sample", "share", "calls/sample"):
            t.add_column(col, justify="left" if col == "op" else "right")
        for o in prof.ops:
            t.add_row(o.op, f"{o.ms_per_run:.3f}", f"{o.share:.1%}", f"{o.calls_per_run:.0f}")
        console.print(t)

    run_cli(go)


@app.command()
def demo(
    out: OutOpt = None,
    targets: TargetsOpt = None,
    variants: VariantsOpt = None,
    include_all: IncludeAllOpt = False,
    full: FullOpt = False,
    lab: LabOpt = False,
    budget: DemoBudgetOpt = None,
    load: LoadOpt = None,
    ray: RayOpt = None,
    quiet: QuietOpt = False,
    no_capacity: NoCapacityOpt = False,
    text: Annotated[bool, typer.Option("--text", help="the sentence-encoder demo: all-MiniLM-L6-v2 on the shipped texts and pairs")] = False,
    seed: Annotated[int, typer.Option("--seed", min=0, help="train another demo model with this seed (once, cached): "
                                      "models differ in how well they quantize")] = 0,
) -> None:
    """The built-in demo: a MobileNetV2 trained (once) on the digits stand-in for Food-11, optimized for three targets
    (run directory runs/demo); with --text, all-MiniLM-L6-v2 on servopt's sample sentences and pairs (runs/demo-text)."""

    def go() -> None:
        from servopt.demo import ensure_demo, ensure_text_demo
        from servopt.models.sources import load_model

        if text:
            folder, data_raw, note = ensure_text_demo()
            loaded, default_out = load_model(folder), Path("runs/demo-text")
        else:
            data_root, weights, training = ensure_demo(log=console.print, seed=seed)
            note = ("demo: MobileNetV2 trained on scikit-learn's handwritten digits, standing in for Food-11 "
                    f"(no download possible here; seed {seed}); validation top-1 {training['validation_top1']:.2%}")
            loaded, default_out = load_model(weights, arch="mobilenet_v2"), Path("runs/demo" if seed == 0 else f"runs/demo-seed{seed}")
            data_raw = {"data": data_root, "split": "evaluation"}
        if not quiet:
            console.print(note)
        settings = optimize_settings(out=out or default_out, targets=targets, variants=variants, include_all=include_all, note=note,
                                     ray=ray, full=full, lab=lab, budget=budget if budget is not None else None if full else DEMO_BUDGET,
                                     load=load, no_capacity=no_capacity)
        run_optimize(loaded, data_raw, settings, quiet, False)

    run_cli(go)
