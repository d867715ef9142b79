"""report.md (tables, for pull requests) and report.html (one self-contained file, opens offline).

Rendering only reads the run directory: every figure, profile and decision was measured or made by the run
(``servopt report`` re-renders without measuring). This module is the entry point, ``write_reports``; each part of
the report lives where its name says:

- ``templates/report.md.j2``, ``templates/report.html.j2``: the two Jinja2 templates;
- ``verdicts_report``: the verdict per target, its bounds, the ISA match, the machine, the interrupted banner;
- ``variants_report``: the "Every variant" table and the Pareto marks;
- ``int8_report``: what each INT8 variant did to keep its accuracy (in its passes' own words) and the search;
- ``remeasure_report``: same-run ratios, duels, capped rounds, each kind of node's section;
- ``prices_report``, ``race_report``, ``data_report``, ``instance_report``, ``compare_report``: their sections;
- ``charts``: every chart, inline SVG drawn with matplotlib (left out, and said so, without it);
- ``report_format``: how a figure, a record's name and a machine are written in all of them.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from jinja2 import Environment
from markupsafe import Markup

from servopt.contracts import Record
from servopt.families.base import Family, family_of
from servopt.optimize.budget_report import budget_section
from servopt.optimize.charts import instance_charts, variant_charts
from servopt.optimize.compare_report import with_html, with_markdown
from servopt.optimize.data_report import data_lines, grid_table
from servopt.optimize.instance_report import instance_section
from servopt.optimize.int8_report import accuracy_search, int8_rows
from servopt.optimize.prices_report import price_section
from servopt.optimize.race_report import race_section
from servopt.optimize.remeasure_report import capped_tables, duel_rows, interleave_rows, kind_sections
from servopt.optimize.rundir import Summary, load_config, load_profile
from servopt.optimize.variants_report import pareto_marks, references_by_kind, variant_rows
from servopt.optimize.verdicts_report import interrupted_banner, machine_line, reused_line, verdict_rows
from servopt.results import write_text_atomic

# The section builders the commands print from (``servopt optimize``'s summary table, ``servopt bench``'s grid).
__all__ = ["grid_table", "interleave_rows", "pareto_marks", "price_section", "race_section", "references_by_kind",
           "variant_rows", "verdict_rows", "write_reports"]

TEMPLATES = resources.files("servopt.optimize") / "templates"


def template(name: str) -> str:
    """The text of one of the report's templates (``report.md.j2``, ``report.html.j2``)."""
    return (TEMPLATES / name).read_text(encoding="utf-8")


def write_reports(out: Path, summary: Summary, records: list[Record]) -> None:
    """Render both reports from what the run stored; nothing is measured here."""
    config = load_config(out)
    reference = next((r for r in records if r.name == summary.reference), None)
    references = references_by_kind(records, summary.reference)
    family = family_of(config.spec) if config else _default_family()
    picked = list(dict.fromkeys((str(d.pick), d.result.measured_for if d.result else None)
                                for d in summary.targets if d.pick))
    picks = [n for n, _ in picked]
    profiles = []
    for name, kind in picked:
        prof = load_profile(out, name, kind)
        if prof is not None:
            profiles.append(prof.model_copy(update={"variant": f"{name} [{kind}]" if kind else name}))
    marks = pareto_marks(summary)
    env_json = summary.environment.model_dump_json(indent=2) if summary.environment else "{}"
    rows = variant_rows(records, reference, marks, family, references)
    ctx: dict[str, Any] = {
        "model": Path(config.model).name if config else "?", "run_dir": str(out), "created": summary.created,
        "machine": machine_line(summary), "verdicts": verdict_rows(summary),
        "interleaved": interleave_rows(summary.interleaved), "rounds": summary.interleaved.rounds if summary.interleaved else None,
        "duels": duel_rows(summary.interleaved, records),
        "capped": capped_tables(summary), "kinds": kind_sections(summary),
        "rows": rows, "int8": int8_rows(rows, records), "pareto": summary.pareto_front,
        "profiles": profiles, "search": accuracy_search(records), "left_out": config.left_out if config else [],
        "environment": env_json, "note": config.note if config else "",
        "data": data_lines(config.data) if config else [], "grid": grid_table(records),
        "prices": price_section(summary), "problems": summary.problems, "race": race_section(summary, records), "budget": budget_section(summary),
        "interrupted": interrupted_banner(summary), "reused": reused_line(summary), "instance": instance_section(summary),
        "batch": (config.protocol.get("batch_size") if config else None) or next((r.batch_size for r in records if r.batch_size), "?"),
    }
    md = Environment(autoescape=False).from_string(template("report.md.j2")).render(**ctx)
    write_text_atomic(out / "report.md", with_markdown(md, out))
    drawn = {**variant_charts(records, reference, marks, family, picks, references), **instance_charts(summary)}
    svgs = {k: Markup(v) for k, v in drawn.items()}  # our own SVG
    html = Environment(autoescape=True).from_string(template("report.html.j2")).render(**ctx, charts=svgs)
    write_text_atomic(out / "report.html", with_html(html, out))


def _default_family() -> Family:
    from servopt.families import FAMILIES

    return FAMILIES.get("image-classification")
