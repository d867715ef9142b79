"""What a runtime environment is: its spec, what a made one holds, where it lives, and the errors of making one."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from servopt.errors import UserError
from servopt.home import default_home

KEY_VERSION = 1  # part of every key: bump it when the way an env is made changes, and every env is rebuilt
ENV_FILE = "env.json"  # the completion marker: an env folder without it is never used
STALE_TMP_S = 3600  # a .tmp folder whose owner cannot be told from its name is stale after this long
# Modules that only one installed distribution may provide: two providers overwrite each other's files.
EXCLUSIVE_MODULES = ("onnxruntime",)
DEFAULT_INDEX = "https://pypi.org/simple"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY = re.compile(r"^[0-9a-f]{16}$")
_ORT_BUILD = re.compile(r"^onnxruntime(-.+)?$")  # onnxruntime, onnxruntime-openvino, onnxruntime-gpu, …
_NETWORK_SIGNS = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
                  "Name or service not known", "Network is unreachable", "ConnectTimeoutError", "Max retries exceeded",
                  "ProxyError", "Read timed out", "Could not fetch URL", "No route to host", "Connection refused")


def _quiet(_line: str) -> None:
    """The default progress sink: say nothing."""


class EnvCreationError(UserError):
    """pip (or venv) could not make a runtime environment.

    ``requirement`` is what pip could not satisfy when it said so; ``offline`` is True when pip's output shows it
    could not reach an index, so callers (and tests) can tell "no network" from "no such package"."""

    def __init__(self, problem: str, fix: str = "", *, requirement: str | None = None, offline: bool = False,
                 log: str = "") -> None:
        super().__init__(problem, fix)
        self.requirement, self.offline, self.log = requirement, offline, log


class EnvSpec(BaseModel):
    """What a runtime's environment must contain; its ``key()`` names the env folder, so a changed spec is a new env."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str  # e.g. "ort-openvino": shown to the user and in the folder name
    requirements: list[str]  # pip requirement strings
    python: Path = Field(default_factory=lambda: Path(sys.executable))  # the interpreter the venv is based on
    index_url: str | None = None
    extra_index_url: list[str] = []
    find_links: list[str] = []
    no_index: bool = False

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not _NAME.match(v) or v.startswith(".tmp"):
            raise ValueError(f"env name {v!r} must be letters, digits, '.', '_' or '-' (it becomes a folder name)")
        return v

    @field_validator("requirements")
    @classmethod
    def _clean_requirements(cls, v: list[str]) -> list[str]:
        out = [" ".join(r.split()) for r in v if r.strip()]
        for r in out:
            if r.startswith("-"):
                raise ValueError(f"{r!r} is a pip option, not a requirement: use index_url, extra_index_url, find_links or no_index")
        return out

    def key(self) -> str:
        """16 hex digits over the sorted requirements, the base Python (version, implementation, machine) and the
        index options: the same spec in any order gives the same key, and a new Python gets a new env."""
        base = interpreter_info(self.python)
        payload = {"v": KEY_VERSION, "requirements": sorted(set(self.requirements)),
                   "python": base["version"], "implementation": base["implementation"], "machine": base["machine"],
                   "index_url": self.index_url, "extra_index_url": sorted(self.extra_index_url),
                   "find_links": sorted(self.find_links), "no_index": self.no_index}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def pip_options(self) -> list[str]:
        opts = ["--no-index"] if self.no_index else []
        if self.index_url:
            opts += ["--index-url", self.index_url]
        for url in self.extra_index_url:
            opts += ["--extra-index-url", url]
        for link in self.find_links:
            opts += ["--find-links", link]
        return opts


class ReadyEnv(BaseModel):
    """A complete env, as recorded in its ``env.json``; ``size_mb`` is its size when it was created."""

    model_config = ConfigDict(frozen=True)

    name: str
    key: str
    folder: Path
    python: Path  # the env's interpreter: run the runtime's jobs with it
    packages: dict[str, str]  # distribution name → version, read inside the env
    python_version: str
    created_at: float  # epoch seconds
    created_s: float  # how long the creation took
    size_mb: float
    spec: EnvSpec


class EnvInfo(BaseModel):
    """One folder under ``<home>/envs`` as ``list_envs`` sees it, sized now."""

    name: str
    key: str
    folder: Path
    state: Literal["ready", "incomplete", "building"]  # incomplete: never used, rebuilt or pruned
    size_mb: float
    used_by: list[str] = []  # the runtimes (of those passed to list_envs) whose spec is this env
    env: ReadyEnv | None = None  # when ready


# ---------------------------------------------------------------------------------------------------------- paths


def envs_root(home: Path | None = None) -> Path:
    return (home or default_home()) / "envs"


def env_dir(spec: EnvSpec, home: Path | None = None) -> Path:
    return envs_root(home) / f"{spec.name}-{spec.key()}"


def _lock_path(root: Path, folder_name: str) -> Path:
    return root / ".locks" / f"{folder_name}.lock"


def _parse_folder(name: str) -> tuple[str, str, bool] | None:
    """(env name, key, is_tmp) from ``<name>-<key>`` or ``.tmp-<name>-<key>-<random>``; None for anything else."""
    is_tmp = name.startswith(".tmp-")
    parts = name.removeprefix(".tmp-").rsplit("-", 2 if is_tmp else 1)
    if len(parts) != (3 if is_tmp else 2) or not _KEY.match(parts[1]) or not _NAME.match(parts[0]):
        return None
    return parts[0], parts[1], is_tmp


# ---------------------------------------------------------------------------------------------------- interpreters


_PROBE = ("import json, platform, sys; print(json.dumps({'version': platform.python_version(), "
          "'implementation': sys.implementation.name, 'machine': platform.machine()}))")


def interpreter_info(python: Path) -> dict[str, str]:
    """Version ``X.Y.Z``, implementation and machine of ``python``; asked once per interpreter file."""
    try:
        stat = Path(python).stat()
    except OSError:
        raise UserError(f"the Python interpreter {python} does not exist",
                        fix="give EnvSpec(python=...) an existing interpreter, or leave it out to use this one") from None
    return _interpreter_info(str(python), stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _interpreter_info(python: str, _mtime_ns: int) -> dict[str, str]:
    import platform

    if Path(python).resolve() == Path(sys.executable).resolve():
        return {"version": platform.python_version(), "implementation": sys.implementation.name, "machine": platform.machine()}
    proc = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise UserError(f"the Python interpreter {python} does not run: {proc.stderr.strip()[-300:]}",
                        fix="point EnvSpec(python=...) at a working Python 3 interpreter")
    return json.loads(proc.stdout)


def _clean_env() -> dict[str, str]:
    """The environment for the env's own interpreter: nothing from this one's PYTHONPATH or user site leaks in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env
