"""The report's "Data" lines (what the evaluation data was; for text, token lengths and padding) and its throughput
grid by batch × sequence length, with the real texts in arrival order against sorted by length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servopt.contracts import Record
from servopt.report.sections import ReportInput, section


@dataclass
class GridTable:
    """Throughput (samples/s) per variant at each batch × sequence length, and on the real texts by batching order."""

    points: list[str]
    rows: list[tuple[str, list[str]]]
    batching: list[tuple[str, str, str, str, str]]  # variant, first-come/s, sorted/s, waste first-come, waste sorted


def grid_table(records: list[Record]) -> GridTable | None:
    with_grid = [r for r in records if r.status == "ok" and (r.grid or r.length_batching)]
    if not with_grid:
        return None
    points = list(dict.fromkeys(f"{g.batch}×{g.sequence}" for r in with_grid for g in r.grid or []))
    rows = [(r.name, [next((f"{g.throughput_ips:.0f}" for g in r.grid or [] if f"{g.batch}×{g.sequence}" == p), "—") for p in points])
            for r in with_grid]
    batching = [(r.name, f"{b.first_come_ips:.0f}", f"{b.sorted_ips:.0f}", f"{b.first_come_waste:.2f}", f"{b.sorted_waste:.2f}")
                for r in with_grid if (b := r.length_batching)]
    return GridTable(points=points, rows=rows, batching=batching)


def data_lines(data: dict[str, Any]) -> list[str]:
    """What the evaluation data was, in a few lines (text models: the token length distribution and padding)."""
    lines = [f"evaluation data: {data.get('eval', '?')} ({data.get('samples', '?')} samples)"]
    tokens = data.get("tokens")
    if tokens:
        lines.append(f"token lengths: p50 {tokens['p50']:.0f}, p95 {tokens['p95']:.0f}, max {tokens['max']} "
                     f"(model limit {tokens['max_length']}); {tokens['truncated']} of {tokens['count']} texts truncated")
    waste = data.get("padding_waste_b32")
    if waste:
        lines.append(f"padding at batch 32: {waste['first_come']:.2f} padded tokens per real token in arrival order, "
                     f"{waste['sorted']:.2f} sorted by length")
    if data.get("pairs"):
        lines.append(f"{data['pairs']} scored pairs judged (Spearman of cosine with the scores)")
    if data.get("split"):  # what no choice saw: the quality verdict's samples (issue 34)
        lines.append(f"split: {data['split']}")
    if data.get("labels"):  # how folders became the model's indices (issue 41)
        lines.append(f"classes: {data['labels']}")
    if data.get("outputs"):  # what the confident/unsure split read (issue 41)
        lines.append(f"outputs: {data['outputs']}")
    if data.get("torch_weights"):
        lines.append(torch_weights_line(data["torch_weights"]))
    return lines


@section("data")
def _data(r: ReportInput) -> list[str]:
    return data_lines(r.config.data) if r.config else []


@section("grid")
def _grid(r: ReportInput) -> GridTable | None:
    return grid_table(r.records)


def torch_weights_line(checked: dict[str, Any]) -> str:
    """An ONNX encoder against the PyTorch weights beside it (``export.verify_against_weights``), in one line."""
    figures = f"max |Δ| {checked['max_abs_diff']:.2g}" + (f", lowest cosine {checked['min_cosine']:.6f}" if "min_cosine" in checked else "")
    if checked.get("within_tolerance"):
        return f"the ONNX file agrees with the folder's PyTorch weights ({checked['weights']}): {figures} over {checked['checks']} batches"
    return (f"the ONNX file DIFFERS from the folder's PyTorch weights ({checked['weights']}): {figures} over {checked['checks']} "
            f"batches (bounds: |Δ| {checked['tolerance']:.0e}, cosine {checked['min_cosine_bound']}); the variants are judged "
            "against the ONNX file: check --output and the folder's pooling (modules.json)")
