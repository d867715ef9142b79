"""The lock (requirements-lock.txt): the installed environment is the locked set, and the lock still satisfies
pyproject's ranges.

The environment check reads only this interpreter's own site-packages: once anything imports setuptools (≥ 71), its
vendored dist-infos (setuptools/_vendor: platformdirs, jaraco.*, …) join ``sys.path`` and a plain
``importlib.metadata.distributions()`` lists them beside the venv's own, at other versions (it failed CI once).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements-lock.txt"
MARKER = "servopt-lock.sha256"  # written into the venv by `make install`: the sha256 of the lock it installed
NOT_LOCKED = {"pip", "servopt"}  # pip comes with the interpreter's venv; servopt is installed editable on top
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)\s*(?:\\|$)")


def read_lock(text: str) -> dict[str, str]:
    """``{canonical name: version}`` of every ``name==version`` pin (hash and comment lines skipped)."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        m = _PIN.match(line)
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def site_dirs() -> list[str]:
    """This interpreter's own site-packages (purelib and platlib), nothing else on sys.path."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def installed(dirs: list[str]) -> dict[str, str]:
    """``{canonical name: version}`` of the distributions installed in ``dirs`` only."""
    out: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=dirs):
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonicalize_name(name), dist.version)
    return out


def differences(lock: dict[str, str], have: dict[str, str], ignore: set[str] = NOT_LOCKED) -> list[str]:
    """What keeps ``have`` from being exactly the locked set, one line per package."""
    problems = [f"{n}: locked {v}, not installed" for n, v in sorted(lock.items()) if n not in have]
    problems += [f"{n}: locked {v}, installed {have[n]}" for n, v in sorted(lock.items()) if n in have and Version(have[n]) != Version(v)]
    problems += [f"{n}: installed {v}, not in the lock" for n, v in sorted(have.items()) if n not in lock and n not in ignore]
    return problems


def all_requirements(pyproject: dict, extra: str = "all") -> list[Requirement]:
    """The core dependencies plus ``extra``, with servopt's self-references (``servopt[torch,…]``) expanded."""
    extras = pyproject["project"]["optional-dependencies"]
    reqs = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    todo, seen = [extra], set()
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        for r in map(Requirement, extras[e]):
            if canonicalize_name(r.name) == "servopt":
                todo.extend(r.extras)
            else:
                reqs.append(r)
    return reqs


# ------------------------------------------------------------------------------------------- the lock itself


def test_every_pin_has_hashes_and_torch_is_the_local_cpu_build() -> None:
    text = LOCK.read_text()
    pins = read_lock(text)
    assert len(pins) > 50, f"{LOCK.name} pins only {len(pins)} packages: regenerate it with `make lock`"
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    unhashed = [b.split()[0] for b in blocks if _PIN.match(b) and "--hash=sha256:" not in b]
    assert not unhashed, f"pins without hashes (pip --require-hashes refuses the file): {unhashed}; run `make lock`"
    assert "servopt @" not in text, "the lock pins servopt itself; `make lock` passes --unsafe-package servopt"
    torch = Version(pins["torch"])
    assert torch.local == "cpu", f"torch is locked as {torch}: not the local CPU wheel (+cpu); a CUDA build is several GB"
    assert not [n for n in pins if n.startswith("nvidia-")], "CUDA libraries in the lock: torch resolved to a CUDA build"


def test_lock_satisfies_pyproject() -> None:
    """Every requirement of ``.[all]`` is locked at a version its range allows (else: pyproject changed, `make lock`)."""
    pins = read_lock(LOCK.read_text())
    reqs = all_requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    missing = sorted({r.name for r in reqs if canonicalize_name(r.name) not in pins and (r.marker is None or r.marker.evaluate())})
    assert not missing, f"in pyproject's [all] but not in {LOCK.name}: {missing}; run `make lock`"
    outside = [f"{r} (locked {pins[canonicalize_name(r.name)]})" for r in reqs
               if canonicalize_name(r.name) in pins and not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)]
    assert not outside, f"locked versions outside pyproject's ranges: {outside}; run `make lock`"
    build = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]]
    assert all(canonicalize_name(r.name) in pins and r.specifier.contains(pins[canonicalize_name(r.name)]) for r in build), \
        "the build backend is not locked: `make install` builds servopt with --no-build-isolation from the locked setuptools"


# ------------------------------------------------------------------------------------- reading the environment


def test_read_lock_takes_pins_not_hashes_or_comments() -> None:
    text = ("#    pip-compile --generate-hashes\nTorch==2.13.0+cpu \\\n    --hash=sha256:ab\n    # via servopt\n"
            "zope.interface==8.7 \\\n    --hash=sha256:cd\npyyaml==6.0.4\n# servopt\n")
    assert read_lock(text) == {"torch": "2.13.0+cpu", "zope-interface": "8.7", "pyyaml": "6.0.4"}


def _dist(root: Path, name: str, version: str) -> None:
    d = root / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_installed_reads_only_the_given_site_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What setuptools does to sys.path on import (its _vendor dist-infos) must not change what is 'installed'."""
    site, vendor = tmp_path / "site-packages", tmp_path / "setuptools" / "_vendor"
    _dist(site, "platformdirs", "4.14.8")
    _dist(site, "setuptools", "84.2.1")
    _dist(vendor, "platformdirs", "4.2.2")
    _dist(vendor, "jaraco.functools", "4.0.1")
    monkeypatch.syspath_prepend(str(vendor))
    assert installed([str(site)]) == {"platformdirs": "4.14.8", "setuptools": "84.2.1"}
    assert differences({"platformdirs": "4.14.8", "setuptools": "84.2.1"}, installed([str(site)])) == []


def test_differences_names_each_problem() -> None:
    lock = {"numpy": "2.4.6", "torch": "2.13.0+cpu", "onnxruntime": "1.32.0"}
    have = {"numpy": "2.4.6", "torch": "2.13.0+cpu", "onnxruntime": "1.33.0", "pip": "23.2.1", "servopt": "0.1.0", "extra-pkg": "1"}
    assert differences(lock, have) == ["onnxruntime: locked 1.32.0, installed 1.33.0", "extra-pkg: installed 1, not in the lock"]
    assert differences(lock, {"numpy": "2.4.6"}) == ["onnxruntime: locked 1.32.0, not installed", "torch: locked 2.13.0+cpu, not installed"]


def test_installed_environment_matches_lock() -> None:
    """The environment `make install` made (make test, CI) is exactly the locked set, at the locked versions.

    Skipped in an environment not installed from the lock (no marker) unless SERVOPT_REQUIRE_LOCK=1 (.ci/run sets it)."""
    marker = Path(sys.prefix) / MARKER
    if not marker.exists():
        if os.environ.get("SERVOPT_REQUIRE_LOCK") == "1":
            pytest.fail(f"{sys.prefix} was not installed from {LOCK.name} (no {MARKER}): run `make install`")
        pytest.skip(f"this environment ({sys.prefix}) was not installed from the lock (`make install` writes {MARKER})")
    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()
    assert marker.read_text().strip() == digest, f"{LOCK.name} changed since this environment was installed: run `make install`"
    problems = differences(read_lock(LOCK.read_text()), installed(site_dirs()))
    assert not problems, f"{sys.prefix} is not the locked set ({len(problems)}): " + "; ".join(problems) + " — run `make install`"
