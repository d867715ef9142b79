"""The result schema (versioned) and atomic file writes.

Every figure servopt reports goes through ``make_result`` so ``bench``,
``optimize`` and the report share one shape, documented in
docs/results-schema.md and checked by ``schema/result.schema.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

RESULT_SCHEMA = "servopt.result/1"
BENCH_SCHEMA = "servopt.bench/1"
SCHEMA_FILE = Path(__file__).parent / "schema" / "result.schema.json"


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, default=_jsonable)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def append_jsonl(path: Path, record: dict) -> None:
    """Append one record as one write of one line; a reader skips a torn last line (see ``read_jsonl``)."""
    line = json.dumps(record, default=_jsonable) + "\n"
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


def _jsonable(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def make_result(*, name: str, runtime: str, measured: dict, size_mb: float, batch_size: int,
                cold: dict | None, extra: dict | None = None) -> dict:
    """One measured model in the result schema."""
    cold = cold or {}
    result = {
        "schema": RESULT_SCHEMA,
        "name": name,
        "runtime": runtime,
        "status": measured.get("status", "ok"),
        "error": measured.get("error"),
        "size_mb": round(size_mb, 4),
        "batch_size": batch_size,
        "accuracy": measured.get("accuracy"),
        "agreement": measured.get("agreement"),
        "latency_ms": measured.get("latency_ms"),
        "batch_latency_ms": measured.get("batch_latency_ms"),
        "latency_samples_ms": measured.get("latency_samples_ms"),
        "throughput_ips": measured.get("throughput_ips"),
        "cold_start_s": cold.get("total_s"),
        "cold_start": cold or None,
        "peak_rss_mb": cold.get("peak_rss_mb"),
        "interference": measured.get("interference"),
        "environment": measured.get("environment"),
        "load_s": measured.get("load_s"),
        "compile_s": measured.get("compile_s"),
    }
    if extra:
        result.update(extra)
    return result


def validate_result(result: dict) -> None:
    """Raise ``jsonschema.ValidationError`` when a result does not match the documented schema."""
    import jsonschema

    jsonschema.validate(result, json.loads(SCHEMA_FILE.read_text()))
