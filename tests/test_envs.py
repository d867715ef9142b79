"""Runtime environments: created once under a lock, reused, never used half-made, failures named, listed, pruned.

The fast tests install a tiny hand-made wheel with ``--no-index --find-links``: no network. One slow test makes a
real ``onnxruntime-openvino`` env from the index."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from servopt import envs
from servopt.envs import EnvCreationError, EnvSpec, create, ensure_env, inside, job_env, list_envs, prune, spec

TINY = "servopt_tinypkg"


def make_wheel(folder: Path, name: str = TINY, version: str = "1.0") -> Path:
    """A minimal pure-Python wheel, written by hand (no build backend, no network)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: servopt-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def tiny_spec(links: Path, *requirements: str) -> EnvSpec:
    return EnvSpec(name="tiny", requirements=list(requirements) or [f"{TINY}==1.0"], no_index=True, find_links=[str(links)])


def fake_env(home: Path, spec: EnvSpec) -> Path:
    """A complete-looking env folder without running venv: for list/prune, which only read folders."""
    folder = envs.env_dir(spec, home)
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(sys.executable)
    record = {"name": spec.name, "key": spec.key(), "packages": {}, "python_version": "3", "created_at": time.time(),
              "created_s": 0.0, "size_mb": 0.0, "spec": spec.model_dump(mode="json")}
    (folder / envs.ENV_FILE).write_text(json.dumps(record))
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Two threads ensure the same env at once, over a planted interrupted creation (a folder without env.json and a
    leftover .tmp): exactly one creation must happen and neither leftover be used."""
    home = tmp_path_factory.mktemp("home")
    links = tmp_path_factory.mktemp("wheels")
    make_wheel(links)
    spec = tiny_spec(links)
    folder = envs.env_dir(spec, home)
    (folder / "bin").mkdir(parents=True)
    (folder / "half-made").write_text("interrupted")  # no env.json: must never be used
    leftover = folder.parent / f".tmp-{folder.name}-deadbeef"
    leftover.mkdir()
    created: list[float] = []
    lines: list[str] = []
    real_create = create._create

    def counting_create(*args, **kwargs):
        created.append(time.time())
        return real_create(*args, **kwargs)

    results: list = []

    def use() -> None:
        try:
            results.append(ensure_env(spec, lines.append, home=home))
        except Exception as e:  # noqa: BLE001  (shown by the test, not lost in the thread)
            results.append(e)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(create, "_create", counting_create)
        threads = [threading.Thread(target=use) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return {"home": home, "spec": spec, "results": results, "created": created, "lines": lines, "leftover": leftover}


@pytest.mark.slow  # creates a virtual environment with pip (5-6 s)
def test_concurrent_first_use_creates_once_and_ignores_interrupted_leftovers(made):
    assert len(made["results"]) == 2 and not [r for r in made["results"] if isinstance(r, Exception)], made["results"]
    assert len(made["created"]) == 1
    a, b = made["results"]
    assert a == b and a.folder == envs.env_dir(made["spec"], made["home"])
    assert not (a.folder / "half-made").exists() and not made["leftover"].exists()
    assert [p.name for p in a.folder.parent.iterdir() if p.name.startswith(".tmp-")] == []
    assert a.packages[TINY] == "1.0" and a.python_version.count(".") == 2 and a.size_mb > 0
    assert any("Successfully installed" in ln for ln in made["lines"])  # pip's lines were streamed
    assert any("interrupted creation" in ln for ln in made["lines"])


@pytest.mark.slow  # uses the environment the fixture creates with pip
def test_second_use_creates_nothing(made, monkeypatch):
    ready = made["results"][0]
    stamp = (ready.folder / envs.ENV_FILE).stat().st_mtime_ns
    monkeypatch.setattr(create, "_create", lambda *a, **k: pytest.fail("an existing env was created again"))
    again = ensure_env(made["spec"], home=made["home"])
    assert again == ready and (ready.folder / envs.ENV_FILE).stat().st_mtime_ns == stamp
    assert envs.python_for(made["spec"], home=made["home"]) == ready.python


@pytest.mark.slow  # uses the environment the fixture creates with pip
def test_env_runs_servopt_from_source_and_its_scripts_survive_the_rename(made):
    ready = made["results"][0]
    code = "import servopt, servopt_tinypkg, sys; print(servopt.__file__); print(sys.prefix)"
    out = subprocess.run([str(ready.python), "-c", code], capture_output=True, text=True, env=job_env(ready), check=True)
    servopt_file, prefix = out.stdout.split()
    assert Path(servopt_file).is_relative_to(envs.servopt_src()) and Path(prefix) == ready.folder
    pip = ready.folder / "bin" / "pip"
    assert pip.read_text().splitlines()[0] == f"#!{ready.folder}/bin/python3.{sys.version_info.minor}"
    assert not [f.name for f in (ready.folder / "bin").iterdir() if not f.is_symlink() and b".tmp-" in f.read_bytes()]
    assert subprocess.run([str(pip), "--version"], capture_output=True, text=True, env=spec._clean_env()).returncode == 0


@pytest.mark.slow  # creates a virtual environment with pip (5-6 s)
def test_unsatisfiable_requirement_is_named_and_nothing_is_left(tmp_path):
    links = tmp_path / "wheels"
    make_wheel(links)
    spec = tiny_spec(links, f"{TINY}==1.0", "servopt-no-such-package==9.9")
    with pytest.raises(EnvCreationError) as err:
        ensure_env(spec, home=tmp_path)
    assert err.value.requirement == "servopt-no-such-package==9.9" and not err.value.offline
    assert "servopt-no-such-package==9.9" in err.value.problem and "no index" in err.value.problem
    assert err.value.fix
    assert sorted(p.name for p in envs.envs_root(tmp_path).iterdir()) == [".locks"]


def test_key_is_stable_and_covers_what_changes_the_env(tmp_path):
    a = EnvSpec(name="x", requirements=["numpy>=1.26", "onnxruntime-openvino==1.24.1"])
    b = EnvSpec(name="x", requirements=["onnxruntime-openvino==1.24.1", " numpy>=1.26 "])
    assert a.key() == b.key() and len(a.key()) == 16
    assert a.key() == EnvSpec.model_validate_json(a.model_dump_json()).key()
    assert a.key() != EnvSpec(name="x", requirements=["onnxruntime-openvino==1.23.0", "numpy>=1.26"]).key()
    assert a.key() != EnvSpec(name="x", requirements=a.requirements, index_url="https://example.org/simple").key()
    assert envs.env_dir(a, tmp_path).name == f"x-{a.key()}"
    with pytest.raises(ValueError):
        EnvSpec(name="../x", requirements=[])
    with pytest.raises(ValueError):
        EnvSpec(name="x", requirements=["--index-url=https://example.org"])


def test_core_requirements_leave_out_onnxruntime_and_extras():
    core = envs.core_requirements()
    names = [inside._requirement_name(r) for r in core]
    assert "numpy" in names and "pydantic" in names
    assert not any(n.startswith("onnxruntime") for n in names) and "torch" not in names
    spec = envs.runtime_spec("ort-openvino", ["onnxruntime-openvino==1.24.1"])
    assert spec.requirements[0] == "onnxruntime-openvino==1.24.1" and set(core) <= set(spec.requirements)


def test_installed_servopt_is_copied_alone_onto_pythonpath(tmp_path):
    package = tmp_path / "site-packages" / "servopt"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (tmp_path / "site-packages" / "onnxruntime").mkdir()
    first = inside._private_copy(package, tmp_path / "envs")
    assert sorted(p.name for p in first.iterdir()) == ["servopt"]
    assert inside._private_copy(package, tmp_path / "envs") == first
    (package / "new.py").write_text("")
    assert inside._private_copy(package, tmp_path / "envs") != first


def test_list_and_prune(tmp_path):
    a = EnvSpec(name="ort-openvino", requirements=["a==1"])
    b = EnvSpec(name="ort-gpu", requirements=["b==1"])
    folder_a, folder_b = fake_env(tmp_path, a), fake_env(tmp_path, b)
    root = envs.envs_root(tmp_path)
    broken = root / f"tiny-{'0' * 16}"  # no env.json
    broken.mkdir()
    abandoned = root / f".tmp-ort-gpu-{b.key()}-00000001"  # nobody holds its lock
    abandoned.mkdir()
    building = root / f".tmp-ort-x-{'1' * 16}-00000002"
    building.mkdir()
    odd_old, odd_new = root / ".tmp-whatever-old", root / ".tmp-whatever-new"
    odd_old.mkdir(), odd_new.mkdir()
    os.utime(odd_old, (time.time() - 2 * envs.STALE_TMP_S,) * 2)

    infos = {i.folder.name: i for i in list_envs({"onnxruntime-openvino": a, "other": a}, home=tmp_path)}
    assert infos[folder_a.name].state == "ready" and infos[folder_a.name].used_by == ["onnxruntime-openvino", "other"]
    assert infos[folder_b.name].used_by == [] and infos[folder_b.name].env.spec == b
    assert infos[broken.name].state == "incomplete" and infos[abandoned.name].state == "incomplete"
    with create._locked(spec._lock_path(root, f"ort-x-{'1' * 16}")):  # a creation in progress in "another process"
        assert {i.folder: i.state for i in list_envs(home=tmp_path)}[building] == "building"
        removed = prune(keep={a.key()}, home=tmp_path)
    assert set(removed) == {folder_b, broken, abandoned, odd_old}
    assert folder_a.exists() and building.exists() and odd_new.exists()
    assert set(prune(home=tmp_path)) == {folder_a, building}
    assert list_envs(home=tmp_path) == []


OPENVINO_REQUIREMENT = "onnxruntime-openvino==1.24.1"

_PROVIDERS = """
import json, onnxruntime as ort
print(json.dumps({"version": ort.__version__, "providers": ort.get_available_providers()}))
"""


@pytest.mark.slow
def test_real_openvino_env():
    """A real env with onnxruntime-openvino from the index and servopt's core, the one the runtime declares, made where
    jobs find it (SERVOPT_HOME: the test sandbox's): tests/test_runtime_envs.py measures in the same env, so a session
    makes it once (about 30 s and 500 MB each time; it was made twice). Skipped when pip cannot reach the index."""
    from servopt.runtimes import get_runtime

    spec = get_runtime("onnxruntime-openvino").environment()
    assert spec == envs.runtime_spec("ort-openvino", [OPENVINO_REQUIREMENT])
    lines: list[str] = []
    try:
        ready = ensure_env(spec, lines.append)
    except EnvCreationError as e:
        if e.offline:
            pytest.skip(f"pip cannot reach the index: {e.problem}")
        raise
    print(f"created in {ready.created_s:.1f} s, {ready.size_mb:.0f} MB, {len(ready.packages)} packages")
    assert "onnxruntime" not in ready.packages and ready.packages["onnxruntime-openvino"] == "1.24.1"
    out = subprocess.run([str(ready.python), "-c", _PROVIDERS], capture_output=True, text=True, env=job_env(ready), check=True)
    assert "OpenVINOExecutionProvider" in json.loads(out.stdout)["providers"]
    check = subprocess.run([str(ready.python), "-c", "import servopt.runtimes.base"], env=job_env(ready))
    assert check.returncode == 0
