"""``servopt package``: a folder a team can deploy (artifact, manifest, requirements, Dockerfile).

``servopt serve PACKAGE`` reads ``manifest.json`` (artifact, runtime and its
options, model spec, serving settings), so the container's command is one line
and no runtime option is translated into command-line flags. The footprint
comparison mirrors the tutorial's container sizes: the installed size of the
serving environment against a PyTorch one, summed from the files each
installed distribution (and its dependencies) owns. What serving needs is read
from servopt's own declaration (pyproject's dependencies and ``serve`` extra),
and the settings a package records from ``ServeSettings`` itself; a package
copies the model's own files only, never one from outside its folder.
"""

from __future__ import annotations

import json
import re
import shutil
from importlib import metadata
from pathlib import Path

from servopt import __version__
from servopt.contracts import Contract
from servopt.errors import UserError
from servopt.results import write_json_atomic
from servopt.serve.model import Manifest, ServedModel
from servopt.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[3]  # the source tree's root when running from a checkout (pyproject.toml)
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?")


def _name(requirement: str) -> str:
    """``uvicorn[standard]>=0.29; …`` → ``uvicorn``."""
    match = _REQUIREMENT.match(requirement)
    return match.group(1).lower().replace("_", "-") if match else requirement


def serve_requirements() -> list[str]:
    """What every serving image needs, whatever the runtime: servopt's core dependencies plus its ``serve`` extra, as
    names with their extras (``uvicorn[standard]``), read from the pyproject.toml the shipped wheel is built from, or
    from the installed distribution's metadata when running from an install."""
    pyproject = ROOT / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        declared = [*project["dependencies"], *project["optional-dependencies"]["serve"]]
    else:
        declared = [r.split(";")[0] for r in metadata.requires("servopt") or []
                    if ";" not in r or re.search(r"""extra\s*==\s*["']serve["']""", r)]
    out = []
    for r in declared:
        match = _REQUIREMENT.match(r)
        if match and _name(r) != "servopt":
            out.append(match.group(1) + (match.group(2) or "").replace(" ", ""))
    return list(dict.fromkeys(out))


class Footprint(Contract):
    packages: list[str]
    installed_mb: float
    largest: list[tuple[str, float]]


class FootprintComparison(Contract):
    serving_env: Footprint
    pytorch_env: Footprint
    pytorch_over_serving: float | None
    note: str


class Packaged(Contract):
    out: str
    files: list[str]
    footprint: FootprintComparison


def _dist_size(name: str) -> int:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return 0
    total = 0
    for f in dist.files or []:
        try:
            total += Path(dist.locate_file(f)).stat().st_size
        except OSError:
            continue
    return total


def _closure(names: list[str]) -> set[str]:
    """The distributions ``names`` need, transitively (installed ones only; extras ignored)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        n = re.split(r"[<>=!~;\[ ]", todo.pop(), maxsplit=1)[0].strip().lower().replace("_", "-")
        if not n or n in seen:
            continue
        try:
            dist = metadata.distribution(n)
        except metadata.PackageNotFoundError:
            continue
        seen.add(n)
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(req)
    return seen


def footprint(packages: list[str]) -> Footprint:
    dists = _closure(packages)
    sizes = {d: _dist_size(d) for d in dists}
    return Footprint(packages=packages, installed_mb=round(sum(sizes.values()) / 1e6, 1),
                     largest=sorted(((d, round(s / 1e6, 1)) for d, s in sizes.items()), key=lambda x: -x[1])[:5])


def compare_footprints(model: ServedModel) -> FootprintComparison:
    serving = footprint([*serve_requirements(), *model.family.serving_requirements, *model.backend.serving_requirements(model.artifact)])
    pytorch = footprint([*model.family.torch_serving, "fastapi", "uvicorn"])
    ratio = pytorch.installed_mb / serving.installed_mb if serving.installed_mb else None
    return FootprintComparison(serving_env=serving, pytorch_env=pytorch, pytorch_over_serving=round(ratio, 1) if ratio else None,
                               note="installed sizes on this machine (CPU torch wheel); a CUDA torch build is several GB larger")


def _pin(requirement: str) -> str:
    """``name[extras]==installed version`` (as given when not installed here)."""
    try:
        return f"{requirement}=={metadata.version(_name(requirement))}"
    except metadata.PackageNotFoundError:
        return requirement


def requirements_of(model: ServedModel) -> list[str]:
    """What the deployable installs: for a runtime with an environment of its own, that environment's exact packages
    (it is what was measured), plus the serving packages pinned as installed here."""
    spec = model.backend.environment()
    serving = (*serve_requirements(), *model.family.serving_requirements)
    if spec is None:
        first: dict[str, str] = {}  # one per name: the runtime's own spelling wins
        for r in (*model.backend.serving_requirements(model.artifact), *serving):
            first.setdefault(_name(r), r)
        return [_pin(r) for r in first.values()]
    from servopt.envs import ensure_env

    exact = {name: version for name, version in ensure_env(spec).packages.items() if name not in ("pip", "setuptools", "wheel")}
    known = {_name(n) for n in exact}
    return [f"{n}=={v}" for n, v in sorted(exact.items())] + [_pin(r) for r in dict.fromkeys(serving) if _name(r) not in known]


def _own_file(path: Path, folder: Path, what: str) -> Path:
    """``path``, refused unless it (symbolic links followed) lies inside ``folder``: a package copies the model's own
    files, never one a model file or link points to elsewhere on the host."""
    if not path.resolve().is_relative_to(folder.resolve()):
        raise UserError(f"{what} {path} lies outside {folder}; a package copies only the model's own files",
                        fix=f"put the file inside {folder} (no links or '..' out of it) and re-export")
    return path


def _relative(path: Path, folder: Path) -> Path:
    """``path`` relative to ``folder`` as the model names it (lexically), else through symbolic links resolved."""
    try:
        return path.relative_to(folder)
    except ValueError:
        return path.resolve().relative_to(folder.resolve())


def package(model: ServedModel, out: Path, settings: ServeSettings) -> Packaged:
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty", fix="choose a new --out folder or remove it")
    out.mkdir(parents=True, exist_ok=True)
    from servopt.models.sources import artifact_files

    (out / "model").mkdir()
    ref = model.artifact.ref if model.artifact.format == "torch" else None
    if ref is not None:  # a torch source: the folder or file it loads from, its path made relative
        src = Path(ref.path)
        if src.is_dir():  # a Hugging Face folder: everything but other formats' exports and pickles
            for f in src.rglob("*"):
                _own_file(f, src, "file")
            shutil.copytree(src, out / "model" / src.name, ignore=shutil.ignore_patterns("onnx", "openvino", "*.bin", ".git*"))
        else:
            shutil.copy2(src, out / "model" / src.name)
        ref = ref.model_copy(update={"path": f"model/{src.name}"})
    else:
        src = Path(str(model.artifact.path))
        for f in artifact_files(model.artifact):
            # Kept at its path relative to the model: ONNX names external data by that path (``weights/m.onnx.data``).
            dest = out / "model" / _relative(_own_file(f, src.parent, f"{src.name} refers to"), src.parent)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
    spec = model.spec.model_copy(deep=True)
    for key in model.family.serving_files:  # e.g. the tokenizer: copied in, named relative to the package
        path = Path(str((spec.preprocessing or {}).get(key) or ""))
        if path.is_file():  # named by the model's own spec (its tokenizer), copied as a file of its own name
            shutil.copy2(path, out / "model" / path.name)
            spec.preprocessing[key] = f"model/{path.name}"
    requirements = requirements_of(model)
    manifest = Manifest(servopt=__version__, name=model.name, runtime=model.runtime, runtime_options=model.options,
                        artifact_file=f"model/{src.name}", artifact_format=model.artifact.format, artifact_ref=ref, spec=spec,
                        parameters=model.parameters, requirements=requirements,
                        serve=settings.packaged() | {"instances": model.instances})
    write_json_atomic(out / "manifest.json", manifest)
    wheel = _build_servopt_wheel(out / "wheels")
    reqs = [f"./wheels/{wheel.name}" if wheel else f"servopt=={__version__}", *requirements]
    torch_index = ["--extra-index-url https://download.pytorch.org/whl/cpu"] if any(r.startswith("torch==") for r in requirements) else []
    head = "# the serving environment only: no optimizers" + ("" if torch_index else ", no torch")
    (out / "requirements.txt").write_text("\n".join([head, *torch_index, *reqs]) + "\n")
    cmd = ["servopt", "serve", ".", "--host", "0.0.0.0", "--port", "8000"]
    (out / "Dockerfile").write_text(
        "FROM python:3.11-slim\n"
        "WORKDIR /srv\n"
        "COPY requirements.txt .\n"
        + ("COPY wheels/ wheels/\n" if wheel else "")
        + "RUN pip install --no-cache-dir -r requirements.txt\n"
        "COPY model/ model/\nCOPY manifest.json .\n"
        "EXPOSE 8000\n"
        "# manifest.json holds the runtime, its options and the batching settings (SERVOPT_* variables override them).\n"
        "# Binds 0.0.0.0 inside the container only; set SERVOPT_API_KEY to require a bearer token.\n"
        f"CMD {json.dumps(cmd)}\n"
    )
    report = compare_footprints(model)
    write_json_atomic(out / "footprint.json", report)
    return Packaged(out=str(out), files=sorted(p.name for p in out.rglob("*") if p.is_file()), footprint=report)


def _build_servopt_wheel(dest: Path) -> Path | None:
    """servopt is not on a package index: ship a wheel of the running source with the package (no dependencies:
    requirements.txt lists what serving needs)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    if not (root / "pyproject.toml").exists():
        return None
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest), str(root)],
                          capture_output=True, text=True, timeout=300)
    wheels = sorted(dest.glob("servopt-*.whl"))
    return wheels[-1] if proc.returncode == 0 and wheels else None
