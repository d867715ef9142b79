"""Writing and reading results: atomic files, the append-only JSONL of records, and the versioned schema.

``schema/result.schema.json`` is generated from ``contracts.Record``
(``python -m servopt.results`` rewrites it; a test fails if it is stale).
Version-1 records (servopt 0.1's dicts) are read by ``migrate_v1``, so run
directories made before the typed records still report and serve.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from servopt.contracts import QUALITY_KINDS, RESULT_SCHEMA, Artifact, ChainStep, ModelRef, Record, SessionInfo

SCHEMA_FILE = Path(__file__).parent / "schema" / "result.schema.json"
V1 = "servopt.result/1"
V2 = "servopt.result/2"


def _text_of(obj: Any) -> str:
    if isinstance(obj, BaseModel):
        return obj.model_dump_json(indent=2, by_alias=True)
    return json.dumps(obj, indent=2, default=_jsonable)


def _write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """A pydantic model or plain JSON data, written atomically."""
    _write_atomic(path, _text_of(obj))


def write_text_atomic(path: Path, text: str) -> None:
    _write_atomic(path, text)


def append_jsonl(path: Path, record: Record | dict) -> None:
    """Append one record as one write of one line; a reader skips a torn last line (see ``read_jsonl``)."""
    line = (record.model_dump_json(by_alias=True) if isinstance(record, BaseModel) else json.dumps(record, default=_jsonable)) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a kill mid-write; the variant is simply measured again
    return out


def read_records(path: Path, run_dir: Path | None = None) -> list[Record]:
    """Every record of a ``results.jsonl``, version 1 or 2, as typed records (torn lines skipped)."""
    return [parse_record(d, run_dir) for d in read_jsonl(path)]


def parse_record(data: dict, run_dir: Path | None = None) -> Record:
    """A stored record in today's shape, whatever version wrote it (1 and 2 are migrated on read)."""
    if data.get("schema") == V1:
        data = migrate_v1(data, run_dir)
    if data.get("schema") == V2:
        data = migrate_v2(data)
    return Record.model_validate(data)


def migrate_v2(old: dict) -> dict:
    """A version-2 record (top-level ``accuracy``, ``agreement``, ``pairs``) with those in ``quality``: a classifier's
    when it has accuracy or top-1 agreement, an embedding model's when it has pairs or cosines."""
    new = {k: v for k, v in old.items() if k not in ("accuracy", "agreement", "pairs")}
    new["schema"] = RESULT_SCHEMA
    acc, agr, pairs = old.get("accuracy"), old.get("agreement"), old.get("pairs")
    embedding = pairs is not None or (agr is not None and agr.get("cosine_mean") is not None and agr.get("top1_agreement") is None)
    if embedding:
        new["quality"] = {"kind": "embedding", "agreement": agr, "pairs": pairs}
    elif acc is not None or agr is not None:
        new["quality"] = {"kind": "classification", "accuracy": acc, "agreement": agr}
    return new


def _jsonable(o: Any) -> Any:
    if isinstance(o, BaseModel):
        return o.model_dump(mode="json", by_alias=True)
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


# Version-1 session fields that became SessionInfo fields; the rest move into ``details``.
_SESSION_FIELDS = {"runtime", "provider_requested", "provider_actual", "provider_fallback", "threads"}
_V1_DROPPED = {"variant", "cold_start_s", "peak_rss_mb", "artifact_format", "build_report", "stopped_by"}


def migrate_v1(old: dict, run_dir: Path | None = None) -> dict:
    """A servopt 0.1 record (``servopt.result/1``) in the version-2 shape."""
    new = {k: v for k, v in old.items() if k not in _V1_DROPPED}
    new["schema"] = V2  # then ``migrate_v2``
    new["chain"] = [ChainStep(pass_name=step[0], params=step[1]).model_dump() for step in old.get("chain") or []]
    env = dict(old.get("environment") or {})
    if env:
        session = dict(env.get("session") or {})
        if session:
            info = {k: v for k, v in session.items() if k in _SESSION_FIELDS}
            if "intra_op_threads" in session:
                info.setdefault("threads", session["intra_op_threads"])
            info["details"] = {k: v for k, v in session.items() if k not in _SESSION_FIELDS}
            info.setdefault("runtime", old.get("runtime", "?"))
            info.setdefault("provider_requested", info.get("provider_actual", "?"))
            info.setdefault("provider_actual", info["provider_requested"])
            env["session"] = SessionInfo.model_validate(info).model_dump()
        env.setdefault("cpu", "?")
        new["environment"] = env
    new["artifact"] = _v1_artifact(old, run_dir)
    if new.get("cold_start") is not None:
        new["cold_start"] = {k: v for k, v in new["cold_start"].items() if k in
                             ("total_s", "imports_s", "load_s", "first_inference_s", "peak_rss_mb", "compile_s", "error")}
    return new


def _v1_artifact(old: dict, run_dir: Path | None) -> dict | None:
    fmt, path = old.get("artifact_format"), old.get("artifact")
    if not fmt:
        return None
    if fmt == "torch":
        # Version 1 kept a torch variant's model reference only in its worker's job file.
        job = (run_dir / "work" / old["name"] / "job.json") if run_dir else None
        if job is None or not job.exists():
            return None
        ref = json.loads(job.read_text())["artifact"]["ref"]
        return Artifact(format="torch", ref=ModelRef.model_validate(ref)).model_dump()
    return Artifact(format=fmt, path=path, report=old.get("build_report")).model_dump()


def result_schema() -> dict:
    """``Record``'s JSON Schema, with ``quality`` as the union of the registered families' quality kinds."""
    schema = Record.model_json_schema(by_alias=True)
    defs = schema.setdefault("$defs", {})
    kinds = []
    for _, cls in sorted(QUALITY_KINDS.items()):
        sub = cls.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
        defs.update(sub.pop("$defs", {}))
        defs[cls.__name__] = sub
        kinds.append({"$ref": f"#/$defs/{cls.__name__}"})
    for name in ("quality", "tuning_quality"):  # both judgements are the family's kind (held-out and tuning samples)
        described = schema["properties"][name].get("description")
        schema["properties"][name] = {"anyOf": [{"oneOf": kinds}, {"type": "null"}], "default": None,
                                      **({"description": described} if described else {})}
    defs.pop("Quality", None)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = RESULT_SCHEMA
    schema["title"] = f"One measured model ({RESULT_SCHEMA})"
    return schema


def validate_result(result: dict) -> None:
    """Raise ``jsonschema.ValidationError`` when a result does not match the documented schema."""
    import jsonschema

    jsonschema.validate(result, json.loads(SCHEMA_FILE.read_text()))


DOC_FILE = Path(__file__).resolve().parents[2] / "docs" / "results-schema.md"  # in a source checkout
DOC_BEGIN, DOC_END = "<!-- generated by python -m servopt.results: fields -->", "<!-- end of generated fields -->"


def _rows(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[str]:
    return [f"| `{field.alias or name}` | {(field.description or '').replace('|', '/')} |"
            for name, field in model.model_fields.items() if name not in skip]


def schema_doc() -> str:
    """The field tables of docs/results-schema.md, from the contracts' field descriptions (so they cannot drift)."""
    parts = [f"One record (`{RESULT_SCHEMA}`):", "", "| field | meaning |", "|---|---|", *_rows(Record)]
    for kind, cls in sorted(QUALITY_KINDS.items()):
        parts += ["", f"`quality` of kind `{kind}` ({(cls.__doc__ or '').strip().splitlines()[0]}):", "", "| field | meaning |",
                  "|---|---|", *_rows(cls, skip=("kind",))]
    return "\n".join(parts)


def with_schema_doc(text: str) -> str:
    """``text`` (the doc page) with its generated section replaced by ``schema_doc()``."""
    head, _, rest = text.partition(DOC_BEGIN)
    _, _, tail = rest.partition(DOC_END)
    return f"{head}{DOC_BEGIN}\n{schema_doc()}\n{DOC_END}{tail}"


if __name__ == "__main__":  # regenerate the schema file and the field tables of its doc page from the contracts
    SCHEMA_FILE.write_text(json.dumps(result_schema(), indent=1) + "\n")
    print(f"wrote {SCHEMA_FILE}", file=sys.stderr)
    if DOC_FILE.exists():
        DOC_FILE.write_text(with_schema_doc(DOC_FILE.read_text()))
        print(f"wrote {DOC_FILE}", file=sys.stderr)
