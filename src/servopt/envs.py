"""Runtime environments: a Python environment of its own for a runtime whose build clashes with the others.

``onnxruntime``, ``onnxruntime-openvino`` and ``onnxruntime-gpu`` all install the ``onnxruntime`` module and
overwrite each other, so a runtime that needs one of the special builds runs its jobs in a virtual environment made
for it: created on first use under ``<servopt home>/envs/<name>-<key>/``, reused afterwards (``ensure_env``).

servopt is not pip-installed there: its dependencies would pull the plain ``onnxruntime`` back in over the special
build. The env gets servopt's lean core dependencies without any onnxruntime (``core_requirements``) and the
launcher puts servopt's source, and only it, on PYTHONPATH (``job_env``).

An env is complete only when its ``env.json`` exists. It is written last, inside a temporary sibling folder that is
then renamed into place, all under a per-env lock, so neither a killed creation nor two concurrent ones can leave a
half-made env that gets used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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


# ------------------------------------------------------------------------------------------------------- locking


@contextlib.contextmanager
def _locked(path: Path, blocking: bool = True, waiting: Callable[[], None] = lambda: None) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path``; yields False (holding nothing) when ``blocking`` is off and it is taken.

    After locking, the file is checked to still be the one at ``path``: ``prune`` deletes lock files it holds, and a
    process that waited on the deleted one must lock the new one instead."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not blocking:
                    yield False
                    return
                waiting()
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                yield True
                return
        finally:
            os.close(fd)  # releases the lock


# ------------------------------------------------------------------------------------------------------- creation


def _read_ready(folder: Path) -> ReadyEnv | None:
    """The env in ``folder`` if it is complete (``env.json`` readable, interpreter present), else None."""
    try:
        record = json.loads((folder / ENV_FILE).read_text())
        python = folder / "bin" / "python"
        if not python.exists():  # follows the symlink: a removed base Python breaks the env too
            return None
        return ReadyEnv(folder=folder, python=python, **record)
    except (OSError, ValueError, TypeError):
        return None


def ensure_env(spec: EnvSpec, progress: Callable[[str], None] = _quiet, *, home: Path | None = None) -> ReadyEnv:
    """The ready env for ``spec``: read from its ``env.json`` when it exists, created (once, under a lock) when not.

    ``progress`` receives one line at a time (pip's output while creating). Raises ``EnvCreationError`` when pip or
    venv fails; nothing half-made is left behind."""
    folder = env_dir(spec, home)
    ready = _read_ready(folder)
    if ready is not None:
        return ready
    root = folder.parent
    root.mkdir(parents=True, exist_ok=True)

    def waiting() -> None:
        progress(f"another process is creating the environment {spec.name}; waiting for it")

    with _locked(_lock_path(root, folder.name), waiting=waiting):
        ready = _read_ready(folder)  # made by the process we waited for
        if ready is not None:
            return ready
        # Holding the lock, anything else under this name and key is an abandoned creation: its creator held it.
        for leftover in [folder, *root.glob(f".tmp-{folder.name}-*")]:
            if leftover.exists() or leftover.is_symlink():
                progress(f"removing {leftover.name}: an interrupted creation, never used")
                _remove(leftover)
        return _create(spec, folder, progress)


def _create(spec: EnvSpec, folder: Path, progress: Callable[[str], None]) -> ReadyEnv:
    start, created_at = time.perf_counter(), time.time()
    tmp = folder.parent / f".tmp-{folder.name}-{secrets.token_hex(4)}"
    progress(f"creating the Python environment {spec.name} for {', '.join(spec.requirements) or 'nothing'} (once) in {folder}")
    try:
        venv = subprocess.run([str(spec.python), "-m", "venv", "--prompt", spec.name, str(tmp)], capture_output=True, text=True, env=_clean_env())
        if venv.returncode != 0:
            last = (venv.stderr or venv.stdout).strip().splitlines()[-1:] or ["no output"]
            raise EnvCreationError(
                f"cannot create a virtual environment with {spec.python}: {last[0]}",
                fix="install the venv module for that Python (Debian/Ubuntu: apt install python3.X-venv), "
                    "or point EnvSpec(python=...) at a Python that has it", log=venv.stdout + venv.stderr)
        python = tmp / "bin" / "python"
        if spec.requirements:
            _pip_install(spec, python, progress)
        inside = _probe_env(python)
        _check_exclusive(spec, inside)
        _relocate(tmp, folder)
        record = {"name": spec.name, "key": folder.name.rsplit("-", 1)[1], "packages": inside["packages"],
                  "python_version": inside["python_version"], "created_at": created_at,
                  "created_s": round(time.perf_counter() - start, 2), "size_mb": _size_mb(tmp),
                  "spec": spec.model_dump(mode="json")}
        staging = tmp / f".{ENV_FILE}.partial"
        staging.write_text(json.dumps(record, indent=1))
        os.replace(staging, tmp / ENV_FILE)  # last: from here on the folder is a complete env
        os.rename(tmp, folder)
    except BaseException:
        _remove(tmp)
        raise
    ready = _read_ready(folder)
    if ready is None:  # the interpreter vanished between two lines: say so rather than return a broken env
        raise EnvCreationError(f"the environment {spec.name} in {folder} was created but cannot be read back",
                               fix=f"remove {folder} and try again")
    progress(f"environment {spec.name} ready in {ready.created_s:.1f} s ({ready.size_mb:.0f} MB)")
    return ready


def _pip_install(spec: EnvSpec, python: Path, progress: Callable[[str], None]) -> None:
    """``pip install`` the requirements with the env's own pip, streaming its lines to ``progress``."""
    cmd = [str(python), "-m", "pip", "install", "--no-input", "--progress-bar", "off", *spec.pip_options(), *spec.requirements]
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_env(),
                          bufsize=1) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip()
            lines.append(line)
            if line:
                progress(line)
        rc = proc.wait()
    if rc != 0:
        raise _pip_error(spec, python, lines, rc)


def _pip_error(spec: EnvSpec, python: Path, lines: list[str], rc: int) -> EnvCreationError:
    """Say which requirement pip could not satisfy, on which index, and why (offline, or no such version/wheel)."""
    text = "\n".join(lines)
    found = re.search(r"No matching distribution found for (\S+)", text) or re.search(
        r"Could not find a version that satisfies the requirement (\S+)", text)
    versions = re.search(r"\(from versions: ([^)]*)\)", text)
    offline = any(sign in text for sign in _NETWORK_SIGNS)
    index = _index_used(spec, python, lines)
    base = interpreter_info(spec.python)
    where = f"Python {base['version']} on {sys.platform} {base['machine']}"
    if found:
        req = found.group(1)
        problem = f"cannot create the environment {spec.name!r}: pip found no installable {req} on {index}"
        if offline:
            problem += " (it could not reach the index)"
            fix = ("connect to the network, or point EnvSpec.index_url / PIP_INDEX_URL at a reachable mirror, "
                   "or give EnvSpec.find_links a folder holding the wheels")
        else:
            have = versions.group(1).strip() if versions else ""
            fix = (f"check that {req} exists with a wheel for {where} (available there: {have or 'none'}); "
                   "pin a version that does, or add the index that has it (EnvSpec.index_url / extra_index_url)")
        return EnvCreationError(problem, fix, requirement=req, offline=offline, log=text)
    errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR:")] or [ln for ln in lines if ln][-3:]
    return EnvCreationError(
        f"cannot create the environment {spec.name!r}: pip install exited {rc} on {index}: " + " | ".join(errors[:3]),
        fix="read pip's output above; reproduce with: python -m venv /tmp/e && /tmp/e/bin/pip install "
            + " ".join([*spec.pip_options(), *spec.requirements]),
        offline=offline, log=text)


def _index_used(spec: EnvSpec, python: Path, lines: list[str]) -> str:
    """The index pip used: its own "Looking in indexes" line, else the spec, PIP_INDEX_URL, pip's config, the default."""
    links = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Looking in links:")]
    links_note = f" and the find-links {links[0]}" if links else ""
    if spec.no_index:
        return f"no index (--no-index), only the find-links {links[0] if links else ', '.join(spec.find_links) or '(none)'}"
    for ln in lines:
        if ln.startswith("Looking in indexes:"):
            urls = ln.split(":", 1)[1].strip()
            return ("the indexes " if "," in urls else "the index ") + urls + links_note
    if spec.index_url:
        return f"the index {spec.index_url}{links_note}"
    if os.environ.get("PIP_INDEX_URL"):
        return f"the index {os.environ['PIP_INDEX_URL']} (PIP_INDEX_URL){links_note}"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        config = subprocess.run([str(python), "-m", "pip", "config", "list"], capture_output=True, text=True,
                                timeout=60, env=_clean_env()).stdout
        for ln in config.splitlines():
            name, _, value = ln.partition("=")
            if name.endswith(".index-url") and not name.endswith("extra-index-url"):
                return f"the index {value.strip(chr(39))} (pip config {name}){links_note}"
    return f"the default index ({DEFAULT_INDEX}){links_note}"


_ENV_PROBE = """
import importlib.metadata as m, json, platform, sys
packages = {d.metadata["Name"]: d.version for d in m.distributions() if d.metadata["Name"]}
owners = m.packages_distributions()
print(json.dumps({"packages": dict(sorted(packages.items(), key=lambda kv: kv[0].lower())),
                  "python_version": platform.python_version(),
                  "providers": {mod: sorted(set(owners.get(mod, []))) for mod in %r}}))
"""


def _probe_env(python: Path) -> dict:
    """Installed distributions and the Python version, read inside the env (importlib.metadata: no pip needed)."""
    proc = subprocess.run([str(python), "-I", "-c", _ENV_PROBE % (EXCLUSIVE_MODULES,)], capture_output=True, text=True,
                          timeout=120, env=_clean_env())
    if proc.returncode != 0:
        raise EnvCreationError(f"the new environment's Python does not start: {proc.stderr.strip()[-300:]}",
                               fix="check the base Python (EnvSpec.python) runs on its own", log=proc.stderr)
    return json.loads(proc.stdout)


def _check_exclusive(spec: EnvSpec, inside: dict) -> None:
    """Two builds of onnxruntime in one env overwrite each other: refuse the env rather than run whichever won."""
    for module, dists in inside["providers"].items():
        if len(dists) > 1:
            raise EnvCreationError(
                f"the environment {spec.name!r} ended up with {' and '.join(dists)}, which all provide the module "
                f"{module!r} and overwrite each other",
                fix="keep exactly one of them in the requirements, and check no other requirement pulls the other in "
                    "(servopt's core_requirements() leave onnxruntime out; do not add servopt itself)")


def _relocate(tmp: Path, final: Path) -> None:
    """Point the venv's scripts at the folder it is renamed to: venv writes absolute paths into shebangs and activate."""
    old, new = str(tmp).encode(), str(final).encode()
    for path in [*(tmp / "bin").iterdir(), tmp / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if old in data and (data.startswith(b"#!") or path.name.startswith("activate") or path.name == "pyvenv.cfg"):
            path.write_bytes(data.replace(old, new))


def _size_mb(folder: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return round(total / 1e6, 1)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------- servopt inside an env


def _requirement_name(req: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else ""


def core_requirements() -> list[str]:
    """servopt's own core dependencies without any onnxruntime build, for an env that brings its own build.

    Read from the ``pyproject.toml`` of the servopt source that ``job_env`` puts on PYTHONPATH when servopt runs from
    a checkout (the installed metadata may belong to another checkout or an older install), else from the installed
    distribution's metadata; never a copy here, which would drift from pyproject. Extras are left out."""
    import servopt

    package = Path(servopt.__file__).resolve().parent
    pyproject = package.parent.parent / "pyproject.toml"
    requirements: list[str] | None = None
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "servopt":
            requirements = list(project.get("dependencies", []))
    if requirements is None:
        from importlib import metadata

        try:
            requirements = metadata.requires("servopt") or []
        except metadata.PackageNotFoundError:
            raise UserError("cannot tell servopt's dependencies: it is neither installed nor run from its source checkout",
                            fix="pip install servopt (or pip install -e . in the checkout)") from None
    return [r for r in requirements
            if "extra" not in r.partition(";")[2] and not _ORT_BUILD.match(_requirement_name(r))]


def runtime_spec(name: str, requirements: Iterable[str], **options: object) -> EnvSpec:
    """An ``EnvSpec`` for a runtime: its own ``requirements`` plus servopt's core (``core_requirements``).

    ``options`` are the other ``EnvSpec`` fields (python, index_url, extra_index_url, find_links, no_index)."""
    return EnvSpec(name=name, requirements=[*requirements, *core_requirements()], **options)  # type: ignore[arg-type]


def servopt_src(home: Path | None = None) -> Path:
    """The folder to put on PYTHONPATH so an env's interpreter imports this servopt and nothing else from here.

    A source checkout's ``src`` holds servopt alone. An installed servopt sits in a site-packages whose plain
    onnxruntime would shadow the env's build, so a private copy of the package is made (once per content)."""
    import servopt

    package = Path(servopt.__file__).resolve().parent
    if package.parent.name not in ("site-packages", "dist-packages"):
        return package.parent
    return _private_copy(package, envs_root(home))


def _private_copy(package: Path, root: Path) -> Path:
    files = sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for p in files:
        st = p.stat()
        digest.update(f"{p.relative_to(package)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    dest = root / f".servopt-src-{digest.hexdigest()[:16]}"
    if (dest / package.name).is_dir():
        return dest
    tmp = root / f".tmp-servopt-src-{secrets.token_hex(4)}"
    try:
        shutil.copytree(package, tmp / package.name, ignore=shutil.ignore_patterns("__pycache__"))
        os.rename(tmp, dest)
    except OSError:
        if not (dest / package.name).is_dir():  # not a lost race with another process making the same copy
            raise
    finally:
        _remove(tmp)
    return dest


def python_for(spec: EnvSpec, progress: Callable[[str], None] = _quiet, *, home: Path | None = None) -> Path:
    """The interpreter to run ``spec``'s jobs with (the env is created first if it does not exist yet)."""
    return ensure_env(spec, progress, home=home).python


def job_env(ready: ReadyEnv, base: Mapping[str, str] | None = None, *, home: Path | None = None) -> dict[str, str]:
    """The whole environment for a job run with ``ready.python``: ``base`` (default: this process's), with PYTHONPATH
    holding servopt's source and nothing else (an inherited entry could bring the plain onnxruntime back), the env's
    VIRTUAL_ENV and bin first on PATH, and no user site-packages."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "PYTHONHOME"}
    env["PYTHONPATH"] = str(servopt_src(home))
    env["VIRTUAL_ENV"] = str(ready.folder)
    env["PATH"] = str(ready.folder / "bin") + (os.pathsep + env["PATH"] if env.get("PATH") else "")
    env["PYTHONNOUSERSITE"] = "1"
    return env


# ----------------------------------------------------------------------------------------------- listing, pruning


def list_envs(declared: Mapping[str, EnvSpec] | None = None, *, home: Path | None = None) -> list[EnvInfo]:
    """Every env folder with its size now; ``declared`` (runtime name → its spec) fills in which runtimes use each.

    An env no declared runtime uses any more (its spec changed) has an empty ``used_by``: ``prune`` can take it."""
    root = envs_root(home)
    if not root.is_dir():
        return []
    keys = {rt: (spec.name, spec.key()) for rt, spec in (declared or {}).items()}
    infos = []
    for entry in sorted(root.iterdir()):
        parsed = _parse_folder(entry.name)
        if parsed is None:
            continue
        name, key, is_tmp = parsed
        if is_tmp:
            with _locked(_lock_path(root, f"{name}-{key}"), blocking=False) as free:
                state = "incomplete" if free else "building"
            ready = None
        else:
            ready = _read_ready(entry)
            state = "ready" if ready else "incomplete"
        infos.append(EnvInfo(name=name, key=key, folder=entry, state=state, size_mb=_size_mb(entry), env=ready,
                             used_by=sorted(rt for rt, nk in keys.items() if nk == (name, key) and not is_tmp)))
    return infos


def prune(keep: set[str] | None = None, *, home: Path | None = None) -> list[Path]:
    """Remove every env (``keep=None``) or every env whose key is not in ``keep``; returns the folders removed.

    Also removes incomplete envs (even kept ones: they are never used), abandoned ``.tmp`` creations and stale copies
    of servopt's source. An env being created right now (its lock held) is left alone, as is its ``.tmp`` folder: the
    lock tells a live creation from an abandoned one, where an age would guess (the age rule, an hour, is kept only
    for ``.tmp`` folders whose name does not say which env they belong to)."""
    root = envs_root(home)
    if not root.is_dir():
        return []
    removed: list[Path] = []
    current_src = None
    with contextlib.suppress(OSError, UserError):
        current_src = servopt_src(home) if keep is not None else None
    for entry in sorted(root.iterdir()):
        if entry.name == ".locks" or entry == current_src:
            continue
        parsed = _parse_folder(entry.name)
        if parsed is None:
            stale = time.time() - entry.lstat().st_mtime > STALE_TMP_S
            if entry.name.startswith(".servopt-src-") or (entry.name.startswith(".tmp-") and stale):
                _remove(entry)
                removed.append(entry)
            continue
        name, key, is_tmp = parsed
        if not is_tmp and keep is not None and key in keep and _read_ready(entry) is not None:
            continue
        lock = _lock_path(root, f"{name}-{key}")
        with _locked(lock, blocking=False) as free:
            if not free:
                continue  # being created right now
            _remove(entry)
            removed.append(entry)
            if not is_tmp:
                lock.unlink(missing_ok=True)  # safe while held: a waiter re-checks the file after locking
    return removed
