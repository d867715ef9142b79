"""Renders report.md (tables, for pull requests) and report.html (one self-contained file, opens offline) from a
run directory: every section registered in ``sections.SECTIONS`` (one module of this package each) fills its name in
the templates (``templates/report.md.j2``, ``templates/report.html.j2``); the charts (``charts``) go into the HTML; a
comparison's section (``compare``) is appended to both.
"""

from __future__ import annotations

import importlib
import pkgutil
from importlib import resources
from pathlib import Path

from jinja2 import Environment
from markupsafe import Markup

import servopt.report as package
from servopt.contracts import Record
from servopt.optimize.rundir import Summary
from servopt.report.charts import instance_charts, variant_charts
from servopt.report.compare import with_html, with_markdown
from servopt.report.sections import SECTIONS, ReportInput
from servopt.results import write_text_atomic

TEMPLATES = resources.files("servopt.report") / "templates"


def template(name: str) -> str:
    """The text of one of the report's templates (``report.md.j2``, ``report.html.j2``)."""
    return (TEMPLATES / name).read_text(encoding="utf-8")


def register_sections() -> dict:
    """Every section of the package, registered by importing its module: a new section is one module here."""
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    return SECTIONS


def render(out: Path, summary: Summary, records: list[Record]) -> None:
    """Both reports of a run, from what it stored; nothing is measured here."""
    given = ReportInput(out=out, summary=summary, records=records)
    ctx = {name: build(given) for name, build in register_sections().items()}
    md = Environment(autoescape=False).from_string(template("report.md.j2")).render(**ctx)
    write_text_atomic(out / "report.md", with_markdown(md, out))
    picks = [n for n, _ in given.picked]
    drawn = {**variant_charts(records, given.reference, given.marks, given.family, picks, given.references),
             **instance_charts(summary)}
    svgs = {k: Markup(v) for k, v in drawn.items()}  # our own SVG
    html = Environment(autoescape=True).from_string(template("report.html.j2")).render(**ctx, charts=svgs)
    write_text_atomic(out / "report.html", with_html(html, out))
