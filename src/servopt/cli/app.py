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

ModelArg = Annotated[Path, typer.Argument(help="ONNX, TorchScript, .pt2, state_dict (.pt/.pth), pickled module, or a Hugging Face "
                                                "encoder folder (PyTorch weights, or ONNX: Optimum, fastembed, onnx/model.onnx)")]
ArchOpt = Annotated[str | None, typer.Option("--arch", help="zoo architecture for a state_dict: mobilenet_v2, resnet18, resnet50")]
ClassesOpt = Annotated[int | None, typer.Option("--num-classes", help="classes of a state_dict model (default: from its head)")]
TrustOpt = Annotated[bool, typer.Option("--trust-pickle", help="allow loading a pickled nn.Module (runs code from the file)")]
ShapeOpt = Annotated[list[str] | None, typer.Option("--input-shape", help="NAME=1x3x224x224, for models that do not say")]
OutputOpt = Annotated[str | None, typer.Option("--output", help="ONNX sentence encoders: the graph output that holds the "
                                                      "sentence embedding, or the token embeddings to pool (needed when it has several)")]
# Data options are not declared here: each model family declares its own (``DataOptions``), and the commands that
# read data offer every family's (``cli.common.with_data_flags``); one another family uses is refused with that family's list.


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
