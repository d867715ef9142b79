"""Reading a run directory of ``servopt optimize``: the one place that knows its layout on the way in.

Kept free of heavy imports: the server reads run directories too.
"""

from __future__ import annotations

import json
from pathlib import Path

from servopt.errors import UserError
from servopt.results import read_jsonl


def load_run(out: Path) -> tuple[dict, list[dict]]:
    """(summary, records) of an existing run directory."""
    if not (out / "results.jsonl").exists():
        raise UserError(f"{out} is not a servopt run directory (no results.jsonl)", fix="run `servopt optimize … --out DIR` first")
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    # results.jsonl is append-only: a re-measured variant (changed settings) appears again. The run's view is the
    # latest record of each variant of the current configuration.
    latest = {r["name"]: r for r in read_jsonl(out / "results.jsonl")}
    config_path = out / "config.json"
    names = json.loads(config_path.read_text()).get("variants", list(latest)) if config_path.exists() else list(latest)
    return summary, [latest[n] for n in names if n in latest]


def artifact_of(record: dict, out: Path) -> dict:
    """The artifact to open a measured variant again (a torch variant's model reference is in its job file)."""
    if record["artifact_format"] == "torch":
        return {"format": "torch", "ref": json.loads((out / "work" / record["name"] / "job.json").read_text())["artifact"]["ref"]}
    return {"format": record["artifact_format"], "path": record["artifact"]}


def session_of(record: dict, out: Path) -> dict:
    """What a process needs to open the variant: name, artifact, runtime, options."""
    return {"name": record["name"], "artifact": artifact_of(record, out), "runtime": record["runtime"],
            "options": record.get("options") or {}}
