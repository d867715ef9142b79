"""The ``env`` commands: the Python environments servopt made for runtimes that need their own."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from servopt.cli.app import app, console, run_cli

env_app = typer.Typer(no_args_is_help=True, help="Runtime environments (onnxruntime-openvino, onnxruntime-gpu, …).")
app.add_typer(env_app, name="env")


def declared() -> dict:
    """Runtime name → the environment it declares (computing a spec reads pyproject; nothing is created)."""
    from servopt.runtimes import RUNTIMES, get_runtime

    return {name: spec for name in RUNTIMES.names() if (spec := get_runtime(name).environment()) is not None}


@env_app.command("list")
def list_() -> None:
    """The environments servopt has made: which runtimes use them, their size and packages."""

    def go() -> None:
        from servopt.envs import envs_root, list_envs

        envs = list_envs(declared())
        table = Table(title=f"runtime environments in {envs_root()}", title_style="bold")
        for col in ("env", "state", "used by", "size MB", "python", "packages"):
            table.add_column(col, justify="right" if col == "size MB" else "left")
        for e in envs:
            ready = e.env
            pkgs = ", ".join(f"{k}=={v}" for k, v in sorted((ready.packages if ready else {}).items()) if k.startswith(("onnxruntime", "openvino")))
            table.add_row(f"{e.name}-{e.key}", e.state, ", ".join(e.used_by) or "— (stale: prune takes it)", f"{e.size_mb:.0f}",
                          ready.python_version if ready else "", pkgs)
        console.print(table if envs else "no runtime environments yet: they are created on first use")
        for name, spec in declared().items():
            console.print(f"[dim]{name} declares {spec.name}-{spec.key()}: {', '.join(spec.requirements[:1])} + servopt's core[/dim]")

    run_cli(go)


@env_app.command()
def prune(all_: Annotated[bool, typer.Option("--all", help="remove every environment, the ones in use too")] = False) -> None:
    """Remove environments no runtime uses any more (or every one with --all), and abandoned half-made ones."""

    def go() -> None:
        from servopt.envs import prune as remove

        removed = remove(None if all_ else {spec.key() for spec in declared().values()})
        console.print("\n".join(f"removed {p}" for p in removed) or "nothing to remove")

    run_cli(go)
