"""A third model family, written as a plugin would be (``tests/plugins/tabular_family.py``): tabular classifiers on a CSV.

It declares its data options (``--table``), its own quality kind (``tabular``, with balanced accuracy), its bounds and
its judgement, registers itself, and ``servopt optimize`` runs it end to end — flags, data, catalogue, verification in
job processes (which load it through ``SERVOPT_PLUGINS``), decisions, report — with no change anywhere else. That is
what ``families/base.py`` promises a new family costs: one file.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from servopt import registry
from servopt.contracts import QUALITY_KINDS
from servopt.families.base import FAMILIES

PLUGINS = Path(__file__).parent / "plugins"
FEATURES = 6


@pytest.fixture
def tabular(monkeypatch):
    """The plugin loaded as an installed one would be, here and in every job process; gone after the test."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("PYTHONPATH", f"{PLUGINS}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("SERVOPT_PLUGINS", "tabular_family")
    registry.load_plugins()
    yield importlib.import_module("tabular_family")
    FAMILIES.classes.pop("tabular", None)
    QUALITY_KINDS.pop("tabular", None)
    registry._plugins_loaded.discard("tabular_family")
    sys.modules.pop("tabular_family", None)


@pytest.fixture
def table_model(tmp_path):
    """A small MLP trained on a separable table, exported to ONNX with the family named in its metadata."""
    import onnx
    import torch

    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, FEATURES)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 1).astype(np.int64)
    csv = tmp_path / "table.csv"
    np.savetxt(csv, np.column_stack([x, y]), delimiter=",", header=",".join([*(f"f{i}" for i in range(FEATURES)), "label"]),
               comments="", fmt="%.6f")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    for _ in range(200):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    path = tmp_path / "table.onnx"
    torch.onnx.export(net.eval(), (torch.zeros(1, FEATURES),), str(path), input_names=["features"], output_names=["logits"],
                      dynamic_axes={"features": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)
    proto = onnx.load(str(path))
    onnx.helper.set_model_props(proto, {"servopt.spec": json.dumps({"task": "classification", "family": "tabular"})})
    onnx.save(proto, str(path))
    return path, csv


@pytest.mark.slow  # a whole CLI run in job processes: `make test` runs it
def test_a_plugin_family_runs_end_to_end(tabular, table_model, tmp_path):
    from servopt.cli import app

    model, csv = table_model
    out = tmp_path / "run"
    help_text = CliRunner().invoke(app, ["optimize", "--help"], env={"COLUMNS": "200"}).output
    assert "--table" in help_text and "label' column" in help_text, "its data option is a flag, with its description"
    result = CliRunner().invoke(app, ["optimize", str(model), "--table", str(csv), "--out", str(out), "--targets", "cpu-server,edge",
                                      "--quick", "--quiet", "--variants", "ort-fp32", "--variants", "ort-offline-all",
                                      "--variants", "ort-fp16"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["name"] for r in records} == {"ort-fp32", "ort-offline-all", "ort-fp16"}
    for r in records:
        # Without fp16 kernels ORT's CPU provider computes the fp16 graph through casts in fp32, which is read back.
        fp16_cast = r["name"] == "ort-fp16" and "asked for fp16 but onnxruntime runs fp32" in (r["error"] or "")
        assert (r["status"] == "ok" or fp16_cast) and r["quality"]["kind"] == "tabular", r
        assert r["quality"]["balanced_accuracy"] > 0.8 and r["quality"]["accuracy"]["total"] == 180
    summary = json.loads((out / "summary.json").read_text())
    bounds = {b["bound"]: b for b in summary["targets"][0]["verdicts"][0]["bounds"]}
    assert bounds["balanced_accuracy_drop_points"]["kind"] == "quality" and "accuracy_drop_points" in bounds
    assert "balanced" in (out / "report.md").read_text(), "the report describes quality as the family does"
    from servopt.optimize.rundir import load_run

    _, back = load_run(out)
    assert all(isinstance(r.quality, tabular.TabularQuality) for r in back), "read back as the family's own kind"


def test_a_flag_of_another_family_is_refused(tabular, table_model, tmp_path):
    from servopt.cli import app

    model, _ = table_model
    result = CliRunner().invoke(app, ["optimize", str(model), "--texts", str(tmp_path / "x.txt"), "--out", str(tmp_path / "r"),
                                      "--quick", "--quiet"])
    assert result.exit_code == 2 and "--texts" in result.output and "tabular takes" in result.output and "--table" in result.output
