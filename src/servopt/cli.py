"""The ``servopt`` command line (typer + rich). Each command is a thin layer over a module."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from servopt.display import wide_console
from servopt.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Make trained neural networks fast and cheap to serve.")
console = wide_console()
err_console = Console(stderr=True)

ModelArg = Annotated[Path, typer.Argument(help="ONNX, TorchScript, .pt2, state_dict (.pt/.pth) or pickled module")]
ArchOpt = Annotated[str | None, typer.Option("--arch", help="zoo architecture for a state_dict: mobilenet_v2, resnet18, resnet50")]
ClassesOpt = Annotated[int | None, typer.Option("--num-classes", help="classes of a state_dict model (default: from its head)")]
TrustOpt = Annotated[bool, typer.Option("--trust-pickle", help="allow loading a pickled nn.Module (runs code from the file)")]
ShapeOpt = Annotated[list[str] | None, typer.Option("--input-shape", help="NAME=1x3x224x224, for models that do not say")]
DataOpt = Annotated[Path | None, typer.Option("--data", help="image folder: <class>/<img> or Food-11 <split>/<class>/<img>")]
SplitOpt = Annotated[str | None, typer.Option("--split", help="split of a Food-11 layout (default: evaluation)")]


def run_cli(fn):
    """Print a UserError as a clear message (exit 2), never a bare traceback."""
    try:
        return fn()
    except UserError as e:
        err_console.print(f"[bold red]error:[/bold red] {e.problem}")
        if e.fix:
            err_console.print(f"[bold]fix:[/bold] {e.fix}")
        raise typer.Exit(2) from None


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if not verbose:
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" noise


@app.command()
def bench(
    model: ModelArg,
    arch: ArchOpt = None,
    num_classes: ClassesOpt = None,
    trust_pickle: TrustOpt = False,
    input_shape: ShapeOpt = None,
    data: DataOpt = None,
    split: SplitOpt = None,
    limit: Annotated[int | None, typer.Option(help="use at most this many images")] = None,
    strict: Annotated[bool, typer.Option(help="fail on an unreadable image instead of skipping it")] = False,
    resize: Annotated[int | None, typer.Option(help="shorter side after resize (default 224)")] = None,
    crop: Annotated[int | None, typer.Option(help="center-crop size (default 224)")] = None,
    mean: Annotated[str | None, typer.Option(help="normalization mean, e.g. 0.485,0.456,0.406")] = None,
    std: Annotated[str | None, typer.Option(help="normalization std, e.g. 0.229,0.224,0.225")] = None,
    runtime: Annotated[list[str] | None, typer.Option(help="runtimes to measure (default: torch and onnxruntime for torch models)")] = None,
    graph_level: Annotated[str, typer.Option(help="ONNX Runtime graph optimization: disable, basic, extended, all")] = "all",
    threads: Annotated[int | None, typer.Option(help="intra-op threads (default: the runtime's)")] = None,
    batch_size: Annotated[int, typer.Option(help="batch size of the throughput run")] = 32,
    sweep: Annotated[str | None, typer.Option(help="also measure throughput at these batch sizes, e.g. 1,8,64")] = None,
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
        from servopt.cli_common import open_data, open_model, parse_int_list
        from servopt.display import print_results
        from servopt.results import write_json_atomic

        loaded = open_model(model, arch, num_classes, trust_pickle, input_shape)
        dataset = open_data(loaded, data, split, limit=limit, strict=strict, resize=resize, crop=crop, mean=mean, std=std)
        if data is None:
            console.print("[yellow]no --data: inputs are made from the model's signature; accuracy cannot be measured[/yellow]")
        runtimes = runtime or (["torch", "onnxruntime"] if loaded.is_torch else ["onnxruntime"])
        proto = Protocol(min_runs=min_runs, min_seconds=min_seconds, batch_size=batch_size,
                         sweep=parse_int_list(sweep, "--sweep"), cold_start=not no_cold_start,
                         batch_min_seconds=min_seconds)
        ort_opts = {"graph_optimization_level": graph_level, **({"intra_op_threads": threads} if threads else {})}
        opts = {"onnxruntime": ort_opts, "torch": {"threads": threads} if threads else {}}
        wd = workdir or Path(tempfile.mkdtemp(prefix="servopt-bench-"))
        with console.status("measuring…") as status:
            report = bench_model(loaded, dataset, runtimes, proto, wd, runtime_options=opts, opset=opset,
                                 on_progress=lambda m: status.update(m))
        print_results(report["results"], console=console)
        if report.get("export"):
            ex = report["export"]
            console.print(f"exported with the {ex['exporter']} exporter (opset {ex['opset']}); "
                          f"max |onnx − torch| = {ex['max_abs_diff']:.2e}")
        if json_out:
            write_json_atomic(json_out, report)
            console.print(f"figures written to {json_out}")

    run_cli(go)


@app.command()
def export(
    model: ModelArg,
    out: Annotated[Path, typer.Option(help="the .onnx file to write")],
    arch: ArchOpt = None,
    num_classes: ClassesOpt = None,
    trust_pickle: TrustOpt = False,
    input_shape: ShapeOpt = None,
    data: DataOpt = None,
    split: SplitOpt = None,
    opset: Annotated[int, typer.Option(help="ONNX opset")] = 18,
    exporter: Annotated[str, typer.Option(help="auto (dynamo, then TorchScript), dynamo or torchscript")] = "auto",
    tolerance: Annotated[float, typer.Option(help="max abs difference allowed, relative to the logit scale")] = 1e-3,
) -> None:
    """Export a torch model to ONNX and verify it against torch on real inputs."""

    def go() -> None:
        from servopt.cli_common import open_data, open_model
        from servopt.export import export_onnx

        loaded = open_model(model, arch, num_classes, trust_pickle, input_shape)
        if not loaded.is_torch:
            raise UserError(f"{model} is already ONNX", fix="pass a torch model")
        dataset = open_data(loaded, data, split, limit=64) if data else None
        report = export_onnx(loaded, out, opset=opset, exporter=exporter, verify_data=dataset, tolerance=tolerance)
        console.print_json(json.dumps(report))

    run_cli(go)


def _register_more_commands() -> None:
    """Commands in other modules register on ``app`` when imported (each module one concern)."""
    import servopt.cli_optimize
    import servopt.cli_serve  # noqa: F401


_register_more_commands()
