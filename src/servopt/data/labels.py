"""The class names a model knows, and data folders mapped onto its output indices by name.

A classifier's output index k means the class its trainer numbered k; the folder a user sorts images into says the
class by name. Numbering folders by their sorted names (torchvision's ImageFolder) is right only when the model was
trained on the same folders: a model that lists its classes ``0, 90, 180, 270`` scores its own images wrongly under
the sorted ``0, 180, 270, 90``, and a 1000-class model needed 1000 folders. Here each folder is looked up in the
model's own list. Names come as files and metadata write them (``parse_names``): a JSON or Python list or
``{index: name}`` mapping, or newline- or comma-separated text. A folder named with a number or a synset id is an
index only when the user says so (``--labels imagenet``): a model whose classes are ``0, 90, 180, 270`` has a class
*named* ``90`` at index 1.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from servopt.errors import UserError

IMAGENET = "imagenet"  # --labels imagenet: the ImageNet-1k list servopt ships (imagenet_classes.tsv, its source inside)
IMAGENET_FILE = Path(__file__).with_name("imagenet_classes.tsv")
_SYNSET = re.compile(r"n\d{8}")
_GENERIC = re.compile(r"LABEL_\d+")  # transformers' id2label when the trainer gave none: names that say nothing


@dataclass(frozen=True)
class ModelClasses:
    """A model's classes in its output order, where the names came from (for the report), and what else may name a
    class: ``synsets`` (ImageNet's ``n01440764``) and, with ``numbers_are_indices``, a folder named ``285``."""

    names: tuple[str, ...]
    source: str
    synsets: tuple[str, ...] = ()
    numbers_are_indices: bool = False


def parse_names(text: str) -> list[str] | None:
    """Class names as metadata and label files write them, in index order; None when ``text`` holds none.

    A JSON list, a JSON ``{"0": "cat", …}`` mapping (Hugging Face's ``id2label``), a Python literal of either
    (Ultralytics writes ``{0: 'person', …}``; read with ``ast.literal_eval``, which evaluates no code), else one name
    a line, else comma-separated (``0, 90, 180, 270``). A mapping must number every class from 0 without a gap."""
    text = text.strip()
    if not text:
        return None
    value: object = None
    if text[0] in "[{":
        for parse in (json.loads, ast.literal_eval):
            try:
                value = parse(text)
                break
            except (ValueError, SyntaxError, RecursionError):
                continue
    if isinstance(value, dict):
        try:
            by_index = {int(k): str(v).strip() for k, v in value.items()}
        except (TypeError, ValueError):
            return None
        if sorted(by_index) != list(range(len(by_index))):
            return None
        return [by_index[i] for i in range(len(by_index))]
    if isinstance(value, list):
        return [str(v).strip() for v in value] or None
    lines = [line.strip() for line in text.splitlines()]
    if len(lines) > 1:
        return [line for line in lines if line] or None
    return [part.strip() for part in text.split(",")]


def generic(names: list[str]) -> bool:
    """Names that only number the classes (``LABEL_0``, ``LABEL_1`` …: a config.json whose trainer named nothing)."""
    return all(_GENERIC.fullmatch(n) for n in names)


def read_labels_file(path: Path) -> list[str]:
    """``--labels FILE``: one name a line in the model's output order (a JSON list or mapping is read too)."""
    if not path.is_file():
        raise UserError(f"--labels {path}: no such file", fix="give a text file with one class name per line, in the "
                        "model's output order, or --labels imagenet")
    try:
        names = parse_names(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"--labels {path} is not UTF-8 text", fix="save it as UTF-8, one class name per line") from e
    if not names:
        raise UserError(f"--labels {path} holds no class names", fix="one class name per line, in the model's output order")
    return names


@lru_cache(maxsize=1)
def imagenet() -> ModelClasses:
    """ImageNet-1k's 1000 classes (synset id and WordNet lemmas), in the order models trained on it output them."""
    rows = [line.split("\t", 1) for line in IMAGENET_FILE.read_text(encoding="utf-8").splitlines()
            if line and not line.startswith("#")]
    return ModelClasses(tuple(name for _, name in rows), "ImageNet-1k (--labels imagenet)",
                        synsets=tuple(s for s, _ in rows), numbers_are_indices=True)


def _norm(name: str) -> str:
    """How a folder may spell a class: case, ``_`` and ``-`` for spaces (``tabby_cat`` is "tabby cat")."""
    return " ".join(name.replace("_", " ").replace("-", " ").casefold().split())


def _show(classes: ModelClasses, index: int) -> str:
    synset = f"{classes.synsets[index]} " if classes.synsets else ""
    return f"{index} ({synset}{classes.names[index]!r})"


def class_index(folder: str, classes: ModelClasses) -> int | None:
    """The model's index for a folder named ``folder``: its exact name, else (when the user said so) its index or
    synset id, else one of the class's comma-separated names spelt loosely (``tabby_cat`` for "tabby, tabby cat").
    None when no class has that name; a name two classes share is an error naming both."""
    exact = [i for i, n in enumerate(classes.names) if n == folder]
    if len(exact) == 1:
        return exact[0]
    if not exact:
        if classes.numbers_are_indices and folder.isdigit() and int(folder) < len(classes.names):
            return int(folder)
        if folder in classes.synsets:
            return classes.synsets.index(folder)
        key = _norm(folder)
        exact = [i for i, n in enumerate(classes.names) if key in {_norm(n), *(_norm(part) for part in n.split(","))}]
    if len(exact) > 1:
        which = " and ".join(_show(classes, i) for i in exact)
        by = "its synset id or index (--labels imagenet)" if classes.synsets else "a name only one class has"
        raise UserError(f"data folder {folder!r} names {len(exact)} of the model's classes: {which}",
                        fix=f"rename the folder to {by}")
    return exact[0] if exact else None


def folder_indices(folders: list[str], classes: ModelClasses) -> dict[str, int]:
    """Each data folder's index in the model's output, by name. A folder the model does not know, or two folders
    naming one class, is an error that names them."""
    found = {f: class_index(f, classes) for f in folders}
    unknown = [f for f, i in found.items() if i is None]
    if unknown:
        shown = ", ".join(repr(f) for f in unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        known = ", ".join(repr(n) for n in classes.names[:6]) + (" …" if len(classes.names) > 6 else "")
        numbers = any(f.isdigit() or _SYNSET.fullmatch(f) for f in unknown) and not classes.numbers_are_indices
        hint = ("; a folder named by its index or ImageNet synset id counts as one only with --labels imagenet"
                if numbers else "")
        raise UserError(f"the model does not know {len(unknown)} data folder(s): {shown} (its {len(classes.names)} "
                        f"classes, from {classes.source}: {known})",
                        fix="rename each folder to the model's name for its class, or remove it; if the model's names are"
                        f" wrong, give them in its output order with --labels FILE{hint}")
    by_index: dict[int, list[str]] = {}
    for f, i in found.items():
        by_index.setdefault(int(i), []).append(f)  # type: ignore[arg-type]
    twice = {i: fs for i, fs in by_index.items() if len(fs) > 1}
    if twice:
        i, fs = next(iter(twice.items()))
        raise UserError(f"data folders {' and '.join(repr(f) for f in fs)} both name the model's class {_show(classes, i)}",
                        fix="merge them into one folder")
    return {f: int(i) for f, i in found.items()}  # type: ignore[arg-type]


def mapping_note(folders: list[str], classes: ModelClasses | None, outputs: int | None) -> str:
    """How folders were numbered, for the report: by name against the model's classes, or (a model that names none)
    by sorted folder names, with a warning when there are fewer folders than outputs."""
    if classes is not None:
        return (f"by name: each data folder is the model's class of that name ({len(folders)} of its "
                f"{len(classes.names)} classes, names from {classes.source})")
    note = (f"by sorted folder name ({folders[0]!r} = 0 … {folders[-1]!r} = {len(folders) - 1}): the model names no "
            "classes")
    if outputs is not None and len(folders) < outputs:
        note += (f"; it has {outputs} outputs, so unless these folders are its first {len(folders)} classes in this "
                 "order the accuracy is wrong: give its names with --labels FILE (or --labels imagenet)")
    return note
