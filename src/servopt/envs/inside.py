"""servopt inside an environment of its own: its lean core requirements (no onnxruntime), a runtime's spec, the
private copy of servopt's source a job puts on PYTHONPATH, and a job's environment variables."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from servopt.envs.create import _remove, ensure_env
from servopt.envs.spec import _ORT_BUILD, EnvSpec, ReadyEnv, _quiet, envs_root
from servopt.errors import UserError

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


