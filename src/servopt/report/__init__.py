"""The report of a run (``report.md``, ``report.html``): one module per section, the charts, how a figure is written,
the templates. Only the commands render (``servopt optimize``, ``compare``, ``report``): a sweep and a comparison
return their results, and ``write_reports(run_dir)`` renders what the run directory holds.
"""

from __future__ import annotations

from pathlib import Path

from servopt.errors import UserError


def write_reports(run_dir: Path) -> None:
    """report.md and report.html of ``run_dir``, from its summary.json and results (reads only)."""
    from servopt.optimize.rundir import load_run
    from servopt.report.render import render

    summary, records = load_run(run_dir)
    if summary is None:
        raise UserError(f"{run_dir} has results but no summary.json (the run did not finish)", fix="rerun the optimize command")
    render(Path(run_dir), summary, records)
