"""The typer app, the consoles and the options every command shares; command modules register on ``app``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from servopt.cli.display import wide_console
from servopt.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Make trained neural networks fast and cheap to serve.")
console = wide_console()
err_console = Console(stderr=True)

ModelArg = Annotated[Path, typer.Argument(help="ONNX, TorchScript, .pt2, state_dict (.pt/.pth), pickled module, or a Hugging Face encoder folder")]
ArchOpt = Annotated[str | None, typer.Option("--arch", help="zoo architecture for a state_dict: mobilenet_v2, resnet18, resnet50")]
ClassesOpt = Annotated[int | None, typer.Option("--num-classes", help="classes of a state_dict model (default: from its head)")]
TrustOpt = Annotated[bool, typer.Option("--trust-pickle", help="allow loading a pickled nn.Module (runs code from the file)")]
ShapeOpt = Annotated[list[str] | None, typer.Option("--input-shape", help="NAME=1x3x224x224, for models that do not say")]
# Data options: each model family takes its own (an option another family uses is refused with the family's list).
DataOpt = Annotated[Path | None, typer.Option("--data", help="image folder: <class>/<img> or Food-11 <split>/<class>/<img>")]
SplitOpt = Annotated[str | None, typer.Option("--split", help="split of a Food-11 layout (default: evaluation)")]
LimitOpt = Annotated[int | None, typer.Option("--limit", help="evaluate on at most this many samples")]
StrictOpt = Annotated[bool, typer.Option("--strict", help="fail on an unreadable sample instead of skipping it")]
ResizeOpt = Annotated[int | None, typer.Option("--resize", help="shorter side after resize (default 224)")]
CropOpt = Annotated[int | None, typer.Option("--crop", help="center-crop size (default 224)")]
MeanOpt = Annotated[str | None, typer.Option("--mean", help="normalization mean, e.g. 0.485,0.456,0.406")]
StdOpt = Annotated[str | None, typer.Option("--std", help="normalization std, e.g. 0.229,0.224,0.225")]
TextsOpt = Annotated[Path | None, typer.Option("--texts", help="text encoders: texts, one per line (.txt), or .jsonl/.csv with --column")]
ColumnOpt = Annotated[str | None, typer.Option("--column", help="the JSONL key / CSV column with the text (default: text)")]
PairsOpt = Annotated[Path | None, typer.Option("--pairs", help="text encoders: scored pairs (text_a, text_b, score; STS-benchmark TSV too)")]


def run_cli(fn):
    """Print a UserError as a clear message (exit 2), never a bare traceback. Its text is plain, not rich markup:
    ``pip install 'servopt[ray]'`` must print its ``[ray]``."""
    try:
        return fn()
    except UserError as e:
        err_console.print(f"[bold red]error:[/bold red] {escape(e.problem)}")
        if e.fix:
            err_console.print(f"[bold]fix:[/bold] {escape(e.fix)}")
        raise typer.Exit(2) from None


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if not verbose:
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" noise
