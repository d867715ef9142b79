"""The base of every contract (strict: an unknown field is a writer's bug) and the schema names of the files servopt writes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

RESULT_SCHEMA = "servopt.result/3"
BENCH_SCHEMA = "servopt.bench/2"
SUMMARY_SCHEMA = "servopt.summary/2"


class Contract(BaseModel):
    """Strict by default: an unknown field is a bug in the writer, not something to carry silently."""

    model_config = ConfigDict(extra="forbid")
