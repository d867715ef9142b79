"""The ``bench`` and ``export`` commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from servopt.cli.app import ArchOpt, ClassesOpt, ModelArg, OutputOpt, ShapeOpt, TrustOpt, app, console, run_cli
from servopt.cli.common import with_data_flags
from servopt.errors import UserError


@app.command()
@with_data_flags
def bench(
    model: ModelArg,
    data: dict,
    arch: ArchOpt = None,
    num_classes: ClassesOpt = None,
    trust_pickle: TrustOpt = False,
    input_shape: ShapeOpt = None,
    output: OutputOpt = None,
    runtime: Annotated[list[str] | None, typer.Option(help="runtimes to measure (default: torch and onnxruntime for torch models)")] = None,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="runtime option KEY=VALUE, for every runtime that has it")] = None,
    graph_level: Annotated[str | None, typer.Option(help="shorthand for -o graph_optimization_level=… (disable, basic, extended, all)")] = None,
    threads: Annotated[int | None, typer.Option(help="intra-op threads (default: the runtime's)")] = None,
    batch_size: Annotated[int, typer.Option(help="batch size of the throughput run")] = 32,
    sweep: Annotated[str | None, typer.Option(help="also measure throughput at these batch sizes, e.g. 1,8,64")] = None,
    grid: Annotated[str | None, typer.Option(help="text encoders: batch×length points, e.g. 1x16,32x128 (default: 1,8,32 × 16,64,128,256)")] = None,
    min_runs: Annotated[int, typer.Option(help="timed single-sample runs, at least")] = 100,
    min_seconds: Annotated[float, typer.Option(help="timed seconds per phase, at least")] = 5.0,
    no_cold_start: Annotated[bool, typer.Option("--no-cold-start", help="skip the cold-start process")] = False,
    opset: Annotated[int, typer.Option(help="ONNX opset when exporting")] = 18,
    workdir: Annotated[Path | None, typer.Option(help="where exports and logs go (default: a temporary folder)")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the figures to this JSON file")] = None,
) -> None:
    """Measure a model with the servopt benchmark protocol and print the figures."""

    def go() -> None:
        import tempfile

        from servopt.bench.protocol import Protocol
        from servopt.bench.run import bench_model
        from servopt.cli.common import open_data, open_model, parse_grid, parse_int_list, parse_options
        from servopt.cli.display import print_results
        from servopt.results import write_json_atomic
        from servopt.runtimes import get_runtime

        loaded = open_model(model, arch, num_classes, trust_pickle, input_shape, output)
        dataset, note = open_data(loaded, **data)
        if note:
            console.print(f"[yellow]{note}[/yellow]")
        for line, key in (("classes", "labels"), ("outputs", "outputs")):  # how folders became indices, what scores are
            if dataset.meta.get(key):
                console.print(f"[dim]{line}: {escape(dataset.meta[key])}[/dim]")
        runtimes = runtime or (["torch", "onnxruntime"] if loaded.is_torch else ["onnxruntime"])
        from servopt.families import family_of

        family = family_of(loaded.spec)
        proto = Protocol(min_runs=min_runs, min_seconds=min_seconds, batch_size=batch_size,
                         sweep=parse_int_list(sweep, "--sweep"), cold_start=not no_cold_start, batch_min_seconds=min_seconds,
                         grid=parse_grid(grid) if grid else list(family.bench_grid), length_batching=dataset.lengths is not None)
        given = parse_options(option) | ({"graph_optimization_level": graph_level} if graph_level else {})
        opts: dict[str, dict] = {}
        for name in runtimes:  # each runtime takes the options it declares; one no runtime declares is an error
            rt = get_runtime(name)
            mine = {k: v for k, v in given.items() if k in rt.Options.model_fields}
            opts[name] = rt.with_threads(rt.parse_options(mine), threads).model_dump(exclude_defaults=True)
        unused = sorted(set(given) - {k for name in runtimes for k in get_runtime(name).Options.model_fields})
        if unused:
            raise UserError(f"no runtime measured here takes option(s) {unused}",
                            fix="; ".join(f"{n}: {', '.join(get_runtime(n).Options.model_fields)}" for n in runtimes))
        wd = workdir or Path(tempfile.mkdtemp(prefix="servopt-bench-"))
        with console.status("measuring…") as status:
            report = bench_model(loaded, dataset, runtimes, proto, wd, runtime_options=opts, opset=opset,
                                 on_progress=lambda m: status.update(m))
        print_results(report.results, console=console, family=family)
        if any(r.grid for r in report.results):
            from servopt.report.data import grid_table

            table = grid_table(report.results)
            console.print("throughput by batch×length (samples/s): " + "; ".join(
                f"{name}: " + ", ".join(f"{p} {v}" for p, v in zip(table.points, values, strict=True)) for name, values in table.rows))
            for b in table.batching:
                console.print(f"{b[0]} on the real texts: {b[1]}/s in arrival order, {b[2]}/s sorted by length "
                              f"(padding waste {b[3]} vs {b[4]})")
        if report.export:
            ex = report.export
            console.print(f"exported with the {ex['exporter']} exporter (opset {ex['opset']}); "
                          f"max |onnx − torch| = {ex['max_abs_diff']:.2e}")
        if json_out:
            write_json_atomic(json_out, report)
            console.print(f"figures written to {json_out}")

    run_cli(go)


@app.command()
@with_data_flags
def export(
    model: ModelArg,
    out: Annotated[Path, typer.Option(help="the .onnx file to write")],
    data: dict,
    arch: ArchOpt = None,
    num_classes: ClassesOpt = None,
    trust_pickle: TrustOpt = False,
    input_shape: ShapeOpt = None,
    opset: Annotated[int, typer.Option(help="ONNX opset")] = 18,
    exporter: Annotated[str, typer.Option(help="auto (dynamo, then TorchScript), dynamo, torchscript, or torchscript-first (then dynamo)")] = "auto",
    tolerance: Annotated[float, typer.Option(help="max abs difference allowed, relative to the logit scale")] = 1e-3,
) -> None:
    """Export a torch model to ONNX and verify it against torch on real inputs."""

    def go() -> None:
        from servopt.cli.common import open_data, open_model
        from servopt.export import EXPORT_ORDER, export_onnx

        if exporter not in EXPORT_ORDER:
            raise UserError(f"--exporter {exporter!r} is not an exporter", fix=f"pass one of: {', '.join(EXPORT_ORDER)}")
        loaded = open_model(model, arch, num_classes, trust_pickle, input_shape)
        if not loaded.is_torch:
            raise UserError(f"{model} is already ONNX", fix="pass a torch model")
        dataset, note = open_data(loaded, **{"limit": 64, **{k: v for k, v in data.items() if v is not None}})
        report = export_onnx(loaded, out, opset=opset, exporter=exporter, verify_data=None if note else dataset, tolerance=tolerance)
        console.print_json(json.dumps(report))

    run_cli(go)
