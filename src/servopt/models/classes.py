"""What an ONNX classifier says about its outputs: the class names it carries, and whether they are probabilities.

Names: the graph's metadata under the keys exporters use (``labels``, ``classes``, ``class_names``, ``id2label``;
Ultralytics' ``names``; PaddleOCR-style ``character``), else a Hugging Face ``config.json``'s ``id2label`` beside the
file (Optimum's export) or one folder up (the ``onnx/model.onnx`` layout). Kind: a graph whose output is a Softmax
(probabilities) or LogSoftmax (log-probabilities) over the classes, seen through shape-only nodes after it; anything
else is read as logits. The family reads the kind to take confidence from the values as they are.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from servopt.data.labels import generic, parse_names
from servopt.spec import OutputKind

log = logging.getLogger(__name__)

NAME_KEYS = ("labels", "classes", "class_names", "id2label", "names", "character")
# Nodes that move values without changing them: a Softmax seen through them still gives the output's values.
SHAPE_ONLY = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze"}


def names_in_metadata(meta: dict[str, str]) -> tuple[list[str], str] | None:
    """(names, where) from the first metadata key that holds a list of names."""
    for key in NAME_KEYS:
        names = parse_names(meta[key]) if key in meta else None
        if names and not generic(names):
            return names, f"the ONNX metadata {key!r}"
    return None


def names_in_config(model_path: Path) -> tuple[list[str], str] | None:
    """(names, where) from ``id2label`` of a Hugging Face config.json beside the model or one folder up."""
    for config in (model_path.parent / "config.json", model_path.parent.parent / "config.json"):
        if not config.is_file():
            continue
        try:
            id2label = json.loads(config.read_text(encoding="utf-8")).get("id2label")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            log.warning("%s: not read for class names (%s)", config, e)
            continue
        names = parse_names(json.dumps(id2label)) if isinstance(id2label, dict) else None
        if names and not generic(names):
            return names, f"{config}'s id2label"
    return None


def model_class_names(meta: dict[str, str], model_path: Path, outputs: int | None) -> tuple[list[str], str] | None:
    """The names an ONNX classifier carries, with where they came from; a list that is not one name per output is
    not taken (logged: a PaddleOCR ``character`` list is a recognizer's alphabet, not a classifier's classes)."""
    for found in (names_in_metadata(meta), names_in_config(model_path)):
        if found is None:
            continue
        if outputs is not None and len(found[0]) != outputs:
            log.warning("%s: %d names for %d outputs, not taken as class names", found[1], len(found[0]), outputs)
            continue
        return found
    return None


def _attr(node: Any, name: str, default: int) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def final_activation(graph: Any, opset: int) -> OutputKind:
    """``probabilities`` when the graph's first output is a Softmax over its class axis, ``log-probabilities`` for a
    LogSoftmax, else ``logits``. The class axis is 1 or the last (opset < 13's default axis is 1)."""
    producer = {out: node for node in graph.node for out in node.output}
    node = producer.get(graph.output[0].name) if graph.output else None
    while node is not None and node.op_type in SHAPE_ONLY and node.domain in ("", "ai.onnx") and node.input:
        node = producer.get(node.input[0])
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in ("Softmax", "LogSoftmax"):
        return "logits"
    if _attr(node, "axis", -1 if opset >= 13 else 1) not in (1, -1):
        return "logits"
    return "probabilities" if node.op_type == "Softmax" else "log-probabilities"
