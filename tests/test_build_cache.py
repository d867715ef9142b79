"""The build cache is keyed by everything that shapes a build: the source, the chain and its parameters, and the content
of the calibration and tuning data for a pass that reads them; a kill mid-build leaves nothing that a rerun keeps."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TinyNet
from servopt.contracts import ChainStep
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.models.sources import load_model
from servopt.passes import BuildContext, build_chain, get_pass, source_artifact
from servopt.passes.base import build_data_key, chain_data_key, dataset_digest, remove_stale_builds
from servopt.passes.build_job import BuildJob

STATIC = ("ort-quantize-static", {"quant_format": "QDQ", "calibration_samples": 8})
OFFLINE = ("ort-graph-offline", {"level": "basic"})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import torch

    path = tmp_path_factory.mktemp("cache") / "net.onnx"
    torch.onnx.export(TinyNet.build(), (torch.zeros(1, 3, 32, 32),), str(path), dynamo=False, input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}})
    return load_model(path)


def _data(seed: int, n: int = 6) -> Dataset:
    x = np.random.default_rng(seed).standard_normal((n, 3, 32, 32)).astype(np.float32)
    return Dataset({"input": x}, np.arange(n) % 3, ["a", "b", "c"], f"seed {seed}")


def test_a_dataset_digest_is_its_content(tmp_path):
    a = _data(0)
    a.save(tmp_path / "a.npz")
    moved = Dataset(a.inputs, a.labels, a.class_names, "somewhere else")  # same samples, another description and file
    moved.save(tmp_path / "elsewhere.npz")
    assert dataset_digest(tmp_path / "a.npz") == dataset_digest(tmp_path / "elsewhere.npz") == dataset_digest(a)
    assert dataset_digest(_data(1)) != dataset_digest(a), "other samples"
    assert dataset_digest(a.subset(np.arange(4))) != dataset_digest(a), "another count of them"
    relabelled = Dataset(a.inputs, (a.labels + 1) % 3, a.class_names, a.source)
    assert dataset_digest(relabelled) != dataset_digest(a), "tuning labels shape an accuracy-aware build"
    assert build_data_key(None, None) is None
    assert build_data_key(a, None) != build_data_key(None, a), "calibration and tuning are told apart"


@pytest.mark.slow  # over a second: `make test` runs it
def test_other_calibration_data_rebuild_a_step_that_reads_them(model, tmp_path, monkeypatch):
    cache = tmp_path / "artifacts"

    def build(calibration: Dataset, chain=(OFFLINE, STATIC)):
        start = source_artifact(model, data_key=build_data_key(calibration, None))
        return build_chain(start, list(chain), cache, BuildContext(source=model, calibration=calibration))

    monkeypatch.setattr(type(get_pass("ort-graph-offline")), "reads_data", False)  # as a pass that reads no data declares
    first = build(_data(0))
    assert build(_data(0)).path == first.path, "the same samples: cached"
    other = build(_data(1))
    assert other.path != first.path, "other calibration samples: rebuilt"
    fewer = build(_data(0, n=4))
    assert fewer.path != first.path, "another calibration sample count: rebuilt"
    offline = sorted(p.name for p in cache.glob("ort-graph-offline-*"))
    assert len(offline) == 1, "the step that reads no data is built once"
    assert len(list(cache.glob("ort-quantize-static-*"))) == 3
    # Without a data key (an in-process build that names none) the step is keyed as before.
    plain = build_chain(source_artifact(model), [OFFLINE, STATIC], cache, BuildContext(source=model, calibration=_data(1)))
    assert plain.path not in (first.path, other.path, fewer.path)


def test_a_result_key_learns_whether_a_chain_reads_data(model, monkeypatch):
    monkeypatch.setattr(type(get_pass("ort-graph-offline")), "reads_data", False)
    start = source_artifact(model, data_key="k")
    assert chain_data_key(start, [OFFLINE, STATIC]) == "k" and chain_data_key(start, [OFFLINE]) is None
    assert chain_data_key(start, []) is None and chain_data_key(source_artifact(model), [STATIC]) is None


def test_a_build_job_refuses_data_its_key_does_not_name(model, tmp_path):
    _data(0).save(tmp_path / "calib.npz")
    _data(1).save(tmp_path / "other.npz")
    start = source_artifact(model, data_key=build_data_key(tmp_path / "calib.npz", None))
    job = BuildJob(start=start, chain=[ChainStep(pass_name=STATIC[0], params=STATIC[1])], cache=str(tmp_path / "a"),
                   source=model.ref(), calibration=str(tmp_path / "calib.npz"))
    built = job.run(0.0)
    assert Path(built.path).exists() and built.data_key == start.data_key
    with pytest.raises(UserError, match="not the data its cache key names"):
        job.model_copy(update={"calibration": str(tmp_path / "other.npz")}).run(0.0)


def test_a_build_killed_midway_leaves_no_folder_the_next_build_keeps(model, tmp_path):
    """A dead build's ``.tmp-*`` folder (this host, its process gone) is removed by the next build of the step; a live
    process's, or another host's, is left alone."""
    cache = tmp_path / "artifacts"
    cache.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    host = socket.gethostname()
    built = build_chain(source_artifact(model), [OFFLINE], cache, BuildContext(source=model))
    key = Path(built.path).parent.name.rsplit("-", 1)[1]
    stale = cache / f".tmp-{OFFLINE[0]}-{key}-{host}-{dead.stdout.strip()}"
    live = cache / f".tmp-{OFFLINE[0]}-{key}-{host}-{os.getppid()}"
    remote = cache / f".tmp-{OFFLINE[0]}-{key}-another-host-1"
    for folder in (stale, live, remote):
        (folder / "half").mkdir(parents=True)
    assert build_chain(source_artifact(model), [OFFLINE], cache, BuildContext(source=model)).path == built.path
    assert not stale.exists() and live.exists() and remote.exists()
    assert remove_stale_builds(cache, OFFLINE[0], key) == []


@pytest.mark.isa
def test_a_record_of_another_machine_or_library_version_is_measured_again(model, tmp_path, monkeypatch):
    """A rerun into the same --out reuses a record only where the machine and the runtime's libraries are those it was
    measured with: after an ONNX Runtime upgrade, or on another host, the variant is measured again (its key differs)
    instead of mixing old and new figures in one decision; what was reused is listed (``Summary.reused``)."""
    from servopt.contracts import Record
    from servopt.optimize import sweep as sweep_module
    from servopt.optimize import variants
    from servopt.optimize.sweep import Sweep
    from servopt.optimize.targets import PRESETS
    from servopt.results import append_jsonl
    from servopt.settings import OptimizeSettings

    def prepared() -> Sweep:
        settings = OptimizeSettings(out=tmp_path / "run", variants=["ort-fp32"], budget="none")
        sweep = Sweep(model, _data(0), None, None, settings, [PRESETS["cpu-server"]])
        sweep._prepare()
        return sweep

    first = prepared()
    names = {u.variant.name for u in first.units}
    assert "ort-fp32" in names  # an ONNX source: the original is ONNX Runtime's baseline
    for u in first.units:
        append_jsonl(first.dir.results, Record(key=u.key, name=u.variant.name, runtime=u.variant.runtime, status="skipped",
                                               error="measured by the first run"))
    again = prepared()
    assert again._todo() == [] and set(again.reused) == names, "same machine, same libraries: reused, and said so"

    with monkeypatch.context() as m:
        m.setattr(variants, "library_versions", lambda libs: {lib: "9.9.9" for lib in ("numpy", "onnx", "onnxruntime")})
        upgraded = prepared()
        assert {u.variant.name for u in upgraded._todo()} == names and upgraded.reused == [], "ONNX Runtime upgraded"
    # another host with this one's instruction set and cores (a fixed "AMD EPYC 7B12 | avx2 | 2 cores" was this host on
    # a 2-core Zen 2, and is what it reads as under SERVOPT_CPU_READ_AS=avx2 there)
    elsewhere = "Another CPU model | " + variants.machine_signature().split(" | ", 1)[1]
    with monkeypatch.context() as m:
        m.setattr(sweep_module, "machine_signature", lambda: elsewhere)
        moved = prepared()
        assert {u.variant.name for u in moved._todo()} == names and moved.reused == [], "another machine"
    assert {u.key for u in prepared().units} == {u.key for u in first.units}, "back on this machine: the first run's keys"


@pytest.mark.isa
def test_a_record_judged_on_other_outputs_is_measured_again(model, tmp_path):
    """A Softmax model's confident split depends on its outputs being read as probabilities (issue 41): a record judged
    when they were read as logits (before servopt read the graph, or under another --output-kind) is not reused."""
    from servopt.optimize.sweep import Sweep
    from servopt.optimize.targets import PRESETS
    from servopt.settings import OptimizeSettings

    def keys(outputs: str) -> set[str]:
        data = _data(0)
        data.outputs = outputs  # type: ignore[assignment]
        sweep = Sweep(model, data, None, None, OptimizeSettings(out=tmp_path / "run", variants=["ort-fp32"], budget="none"),
                      [PRESETS["cpu-server"]])
        sweep._prepare()
        return {u.key for u in sweep.units}

    logits = keys("logits")
    assert keys("probabilities").isdisjoint(logits) and keys("logits") == logits
