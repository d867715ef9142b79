"""``servopt compare RUN --peers nncf,…``: the tools a user would use instead, measured side by side with the run's pick."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from servopt.cli.app import app, console, run_cli


@app.command()
def compare(
    run_dir: Annotated[Path, typer.Argument(help="a run directory of servopt optimize")],
    peers: Annotated[str, typer.Option(help="comma-separated peers (servopt compare --list names them)")] = "",
    target: Annotated[str | None, typer.Option(help="the target whose pick is compared (default: the first with a pick)")] = None,
    rounds: Annotated[int, typer.Option(help="rounds: every answer measured once per round, the order flipped each round")] = 3,
    quick: Annotated[bool, typer.Option("--quick", help="a smoke run: tiny timing minimums (figures not for decisions)")] = False,
    list_peers: Annotated[bool, typer.Option("--list", help="list the peers and exit")] = False,
) -> None:
    """Build the peers' answers for the run's model and data, measure them with the run's pick (a fresh process per
    measurement, the order flipped each round), write compare.json and the report's comparison section."""

    def go() -> None:
        from servopt.peers.base import PEERS
        from servopt.peers.compare import compare as run_compare
        from servopt.report.compare import columns, ratio_text

        if list_peers:
            for name in PEERS.names():
                peer = PEERS.get(name)
                console.print(f"{name}: {escape(peer.description)} [dim]({', '.join(peer.families) or 'any family'})[/dim]")
            return
        names = [p.strip() for p in peers.split(",") if p.strip()]
        result = run_compare(run_dir, names, target=target, rounds=rounds, quick=quick,
                             progress=lambda m: console.print(f"[dim]{escape(m)}[/dim]"))
        from servopt.report import write_reports

        write_reports(run_dir)  # the run's report, with the comparison's section
        table = Table(title=f"against servopt's pick {result.pick} for {result.target} (peer ÷ pick, median of "
                            f"{result.rounds} rounds, interval)")
        metrics = columns(result)  # the scenarios' own labels, as the report's columns
        for col in ("peer", "status", "quality", *metrics.values()):
            table.add_column(col)
        for p in result.peers:
            by = {r.metric: r for r in p.ratios}
            table.add_row(p.name, p.status if p.status == "ok" else f"{p.status}: {escape(p.why or '')}",
                          escape(p.quality_text), *(escape(ratio_text(by.get(m))) for m in metrics))
        console.print(table)
        if result.pick_note:
            console.print(f"{result.pick}: {escape(result.pick_note)}")
        if result.noisy_rounds:
            console.print(f"rounds with other processes using the CPU: {', '.join(str(i + 1) for i in result.noisy_rounds)}")
        console.print(f"compare.json and the report: {run_dir}")

    run_cli(go)
