"""The report is a layer of its own (``servopt/report``): one module per section, each registered under the name the
templates read, the charts, how a figure is written, the templates, behind one entry point the commands call,
``write_reports(run_dir)``; what an INT8 variant did to keep its accuracy is said by the passes that built it, so a new
pass needs no edit in the report."""

from __future__ import annotations

import fnmatch
import importlib
import tomllib
from pathlib import Path

from servopt.contracts import ChainStep, Record
from servopt.optimize.rundir import load_run
from servopt.passes.base import PASSES, Pass, PassParams
from servopt.report import render

ROOT = Path(__file__).parents[1]
# Each part of the report where its name says (module: the builder it owns).
SECTIONS = {"verdicts": "verdict_rows", "variants": "variant_rows", "int8": "int8_rows", "remeasure": "interleave_rows",
            "prices": "price_section", "race": "race_section", "data": "grid_table", "instance": "instance_section",
            "compare": "with_markdown", "budget": "budget_section", "charts": "variant_charts", "formats": "figure"}


def test_the_report_is_split_by_responsibility():
    for module, builder in SECTIONS.items():
        assert callable(getattr(importlib.import_module(f"servopt.report.{module}"), builder)), f"{module}.{builder}"
    assert callable(importlib.import_module("servopt.report.charts").instance_charts), "every chart in one module"
    entry = Path(render.__file__).read_text()
    for foreign in ("<html", "<table", "import matplotlib", "@dataclass", "| variant |", "@section"):
        assert foreign not in entry, f"render.py renders only; {foreign!r} belongs in a template or a section"
    assert render.template("report.md.j2").startswith("# servopt report: {{ model }}")
    assert render.template("report.html.j2").startswith("<!doctype html>")
    # the templates ship in the wheel
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["servopt"]
    for t in (Path(render.__file__).parent / "templates").iterdir():
        assert any(fnmatch.fnmatch(f"report/templates/{t.name}", g) for g in globs), f"{t.name} is not package data"


def test_every_name_the_templates_read_is_a_registered_section():
    """A new section is one module in report/ (its ``@section`` registers it) plus a line in each template: every name
    a template reads is a registered section (or the HTML's charts), and every section is read by a template."""
    from jinja2 import Environment, meta

    sections = set(render.register_sections())
    read = {name: meta.find_undeclared_variables(Environment().parse(render.template(name)))
            for name in ("report.md.j2", "report.html.j2")}
    assert read["report.md.j2"] <= sections and read["report.html.j2"] <= sections | {"charts"}, read
    assert sections <= read["report.md.j2"] | read["report.html.j2"], "a registered section no template reads"


E = ChainStep(pass_name="export-onnx", params={"opset": 18})
SEARCH = {"points": [{}, {}, {}], "within_tolerance": False,
          "chosen": {"calibrate_method": "Percentile", "percentile": 99.99, "symmetric": True, "reduce_range": True}}
# chain, the last step's build report, runtime options → what the INT8 table says (the words the report said before
# the passes said them, kept byte for byte)
CASES = [
    ([E, ChainStep(pass_name="equalize"), ChainStep(pass_name="ort-quantize-static", params={"calibrate_method": "Entropy",
                                                                                              "reduce_range": True})],
     None, {}, "cross-layer equalization; plain Entropy calibration, 7-bit weights"),
    ([E, ChainStep(pass_name="nncf-quantize-onnx", params={"bias_correction": "none", "preset": "mixed", "model_type": "transformer",
                                                           "overflow_fix": "enable", "activations": "signed"})],
     None, {}, "NNCF range estimation, mixed preset, SmoothQuant, 7-bit weights (overflow fix)"),
    ([E, ChainStep(pass_name="nncf-quantize-onnx", params={"bias_correction": "full"})], None, {"x64_quant_precision": True},
     "NNCF range estimation + full bias correction, activations made unsigned for ONNX Runtime's U8S8 kernels; "
     "ONNX Runtime's x64 precision (U8U8) kernels"),
    ([E, ChainStep(pass_name="ort-quantize-calibration-search")], SEARCH, {},
     "calibration search over 3 points → Percentile 99.99, symmetric, 7-bit weights (none within tolerance)"),
    ([E, ChainStep(pass_name="ort-quantize-calibration-search")], {}, {}, "calibration search over 0 points → ?"),
    ([E, ChainStep(pass_name="ort-quantize-accuracy-aware", params={"calibrate_method": "Percentile"})],
     {"float_layers": ["conv1", "conv2"], "calibration": "Entropy"}, {}, "accuracy-aware: Entropy calibration, 2 layer(s) in float"),
    ([E, ChainStep(pass_name="ort-quantize-accuracy-aware", params={"calibrate_method": "Percentile"})], None, {},
     "accuracy-aware: Percentile calibration, no layer in float"),
    ([E, ChainStep(pass_name="nncf-quantize")], None, {}, "NNCF (OpenVINO)"),
    ([E, ChainStep(pass_name="nncf-accuracy-control")], None, {}, "NNCF (OpenVINO) with accuracy control"),
    ([ChainStep(pass_name="torch-quantize-dynamic")], None, {}, "dynamic (activation ranges at run time)"),
    ([E, ChainStep(pass_name="ort-transformers-optimize"), ChainStep(pass_name="ort-quantize-dynamic", params={"reduce_range": True})],
     None, {}, "dynamic (activation ranges at run time), 7-bit weights"),
    # a plugin pass not installed here is left out; an older servopt's parameter no longer taken is read past
    ([E, ChainStep(pass_name="a-plugin-not-installed", params={"x": 1}),
      ChainStep(pass_name="ort-quantize-static", params={"calibrate_method": "MinMax", "dropped_long_ago": 1})],
     None, {}, "plain MinMax calibration"),
    ([E, ChainStep(pass_name="fp16")], None, {}, "—"),
]


def _int8_table(out: Path, records: list[Record]) -> dict[str, str]:
    summary, _ = load_run(out)
    assert summary is not None
    render.render(out, summary, records)
    md = (out / "report.md").read_text().split("## INT8: points lost and what recovered them\n", 1)[1]
    rows = [line.split(" | ") for line in md.split("\n\n", 1)[0].splitlines()[2:]]
    return {cells[0].lstrip("| "): cells[-1].rstrip(" |") for cells in rows}


def _variants(records: list[Record], cases) -> list[Record]:
    ort = next(r for r in records if r.name == "ort-fp32")
    return [*records, *(ort.model_copy(update={"name": f"int8-{i}", "group": "int8", "chain": chain, "options": options,
                                               "artifact": ort.artifact.model_copy(update={"report": built})})
                        for i, (chain, built, options, _) in enumerate(cases))]


def test_what_an_int8_variant_did_is_said_by_its_passes(run_v1):
    _, records = load_run(run_v1)
    table = _int8_table(run_v1, _variants(records, CASES))
    assert table == {f"int8-{i}": said for i, (*_, said) in enumerate(CASES)}


def test_a_new_int8_pass_needs_no_edit_in_the_report(run_v1):
    class Params(PassParams):
        bits: int = 4

    class FourBit(Pass):
        name = "four-bit-test"
        input_format = output_format = "onnx"
        int8_recipe = True

        @classmethod
        def describe(cls, params, report=None) -> str:
            return f"{params.bits}-bit weights, {(report or {}).get('groups', '?')} groups"

        def run(self, artifact, params, out_dir, ctx):
            raise NotImplementedError

    FourBit.Params = Params
    PASSES.register(FourBit)
    try:
        _, records = load_run(run_v1)
        case = ([E, ChainStep(pass_name="four-bit-test", params={"bits": 3})], {"groups": 128}, {}, "")
        assert _int8_table(run_v1, _variants(records, [case])) == {"int8-0": "3-bit weights, 128 groups"}
    finally:
        PASSES.classes.pop("four-bit-test")


def test_the_comparison_columns_are_the_scenarios_own_labels():
    """One table of labels, the scenarios' (``Scenario.label``, carried in each ratio): a scenario added as one file
    brings its column heading; a compare.json from before labels reads the registered scenario's; a figure of a
    scenario no longer registered keeps its column under its metric name (the texts scenarios once vanished from the
    section for want of a label in the report's own table)."""
    from servopt.peers.contracts import Comparison, PeerRatio, PeerResult
    from servopt.peers.runner import ratios
    from servopt.peers.scenario import SCENARIOS, Scenario, register_scenario
    from servopt.report.compare import markdown

    def ratio(metric: str, scenario: str, label: str = "") -> PeerRatio:
        return PeerRatio(metric=metric, scenario=scenario, label=label, better="lower", ratio=0.4, low=0.35, high=0.45,
                         confidence=0.75, rounds=[0.35, 0.4, 0.45], pick_median=2.0, peer_median=0.8)

    class Warm(Scenario):
        name, metric, better, label = "warm-test", "warm_ms", "lower", "warm p50 (after a pause)"

        def figure(self, m):
            return m

    register_scenario(Warm)
    try:
        rounds = type("R", (), {"measured": {"peer": [2.0, 3.0], "pick": [4.0, 6.0]}})()
        (new,) = ratios(rounds, "pick", "peer", [Warm()])
        assert new.label == "warm p50 (after a pause)" and new.ratio == 0.5
        peer = PeerResult(name="sentence-transformers", status="ok",
                          ratios=[ratio("texts_per_s", "texts"), new, ratio("gone_ms", "retired")])
        c = Comparison(created="2026-11-28", run_dir="r", target="cpu-server", pick="ort-int8", scenarios=["texts"],
                       rounds=3, order=[["a"]], peers=[peer])
        head = markdown(c).splitlines()[4]
        assert head.index("texts in: texts/s (batches)") < head.index("warm p50 (after a pause)") < head.index("gone_ms"), head
    finally:
        SCENARIOS.classes.pop("warm-test")
