"""Making an environment, once, atomically, under a lock: the interpreter it starts from, pip, the checks that what was
installed is what was asked, the rename into place."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from servopt.envs.spec import (
    _NETWORK_SIGNS,
    DEFAULT_INDEX,
    ENV_FILE,
    EXCLUSIVE_MODULES,
    EnvCreationError,
    EnvSpec,
    ReadyEnv,
    _clean_env,
    _lock_path,
    _quiet,
    env_dir,
    interpreter_info,
)

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


