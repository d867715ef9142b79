"""The variant space follows the hardware: CPU features decide the catalogue, precision is read back from the runtime,
a variant that runs another precision than its name fails verification, and ISA caps are recorded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import channel_mean_onnx
from servopt.bench.protocol import Protocol, measure_session
from servopt.contracts import Artifact, SessionInfo
from servopt.cpu import CpuFeatures, Isa, richer
from servopt.data.dataset import Dataset
from servopt.families import FAMILIES
from servopt.machine import Device
from servopt.models.sources import load_model
from servopt.optimize.variants import catalogue, select
from servopt.runtimes import Session, get_runtime, open_session

AVX2 = CpuFeatures(frozenset({"avx2", "fma"}))
ZEN4 = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}))
SAPPHIRE = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_int8", "amx_bf16"}))
ARROW_LAKE = CpuFeatures(frozenset({"avx2", "avx_vnni", "avx_vnni_int8"}))


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory) -> Path:
    return channel_mean_onnx(tmp_path_factory.mktemp("hw") / "m.onnx", size=8)


def test_feature_levels():
    assert (AVX2.level, ZEN4.level, SAPPHIRE.level) == ("avx2", "avx512_vnni", "amx")
    assert not AVX2.int8_dot and ZEN4.int8_dot and ZEN4.bf16 and not ZEN4.fp16 and SAPPHIRE.fp16 and SAPPHIRE.amx
    assert Isa.AVX2 < Isa.AVX512_VNNI < Isa.AMX and not Isa.AVX512_VNNI > Isa.AMX and max(Isa) is Isa.AMX
    assert richer("amx", "avx2") and not richer("avx2", "avx2") and not richer("arm", "avx2") and not richer("avx2", "arm")
    assert not richer(None, "avx2") and not richer("avx512", None)


@pytest.mark.isa
def test_servopt_reads_the_cpu_as_a_poorer_rung_when_told(monkeypatch):
    """SERVOPT_CPU_READ_AS (CI's second pass on a VNNI/AMX machine): servopt's reading drops the richer rungs'
    features and records that it did; the host's own features (what the kernels use) stay as they are."""
    from servopt import machine
    from servopt.errors import UserError

    monkeypatch.setattr(machine, "_cpuinfo_lines", lambda: ["flags\t: " + " ".join(sorted(SAPPHIRE.flags)) + "\n"])
    monkeypatch.delenv(machine.READ_AS_ENV, raising=False)
    assert machine.cpu_features() == SAPPHIRE and machine.environment().cpu_read_as is None
    monkeypatch.setenv(machine.READ_AS_ENV, "avx2")
    seen = machine.cpu_features()
    assert seen.flags == {"avx2"} and seen.level == "avx2" and seen.int8_saturates and not seen.bf16
    assert machine.host_features() == SAPPHIRE
    env = machine.environment()
    assert env.cpu_read_as == "avx2" and env.cpu_flags == ["avx2"] and "read by servopt as avx2" in machine.header(env)
    monkeypatch.setenv(machine.READ_AS_ENV, "avx512_vnni")
    assert machine.cpu_features().level == "avx512_vnni" and not machine.cpu_features().amx
    monkeypatch.setenv(machine.READ_AS_ENV, "avx3")
    with pytest.raises(UserError, match="avx2, avx512, avx512_vnni, amx"):
        machine.cpu_features()


def test_devices_say_where_figures_count():
    from servopt.contracts import Environment

    here, with_gpu = Environment(cpu="x"), Environment(cpu="x", gpu=True)
    assert Device.CPU.measurable_on(here) and not Device.GPU.measurable_on(here) and Device.GPU.measurable_on(with_gpu)
    assert not Device.EDGE.measurable_on(with_gpu), "an edge device is measured on the device itself"
    assert Device.EDGE.computes_on is Device.CPU and Device.GPU.computes_on is Device.GPU
    assert CpuFeatures(frozenset({"asimd", "asimddp", "asimdhp"})).int8_dot
    # ONNX Runtime's S8S8 kernels: VNNI (even AMX) speeds up U8S8 only; signed activations need AVX-VNNI-INT8 or ARM dot products
    assert not ZEN4.int8_signed and not SAPPHIRE.int8_signed and ARROW_LAKE.int8_signed
    assert CpuFeatures(frozenset({"asimd", "asimddp"})).int8_signed


def test_the_catalogue_follows_the_cpu(onnx_model):
    model = load_model(onnx_model)

    def defaults(cpu: CpuFeatures) -> set[str]:
        return {v.name for v in select(catalogue(model, linear_heavy=False, cpu=cpu), None, False)}

    avx2, zen4, spr, arrow = defaults(AVX2), defaults(ZEN4), defaults(SAPPHIRE), defaults(ARROW_LAKE)
    assert "ort-int8-static-qop-s8s8" not in avx2 | zen4 | spr and "ort-int8-static-qop-s8s8" in arrow
    assert "ov-bf16-latency" not in avx2 and {"ov-bf16-latency", "ov-bf16-throughput"} <= zen4
    assert "ov-fp16-latency" not in zen4 and "ov-fp16-latency" in spr
    left = {v.name: v.left_out_why for v in catalogue(model, linear_heavy=False, cpu=AVX2) if not v.default}
    assert "AVX-VNNI-INT8" in left["ort-int8-static-qop-s8s8"] and "bf16" in left["ov-bf16-latency"], "each exclusion says why"
    fp16 = next(v for v in catalogue(model, linear_heavy=False, cpu=AVX2) if v.name == "ort-fp16")
    assert "no fp16 arithmetic" in fp16.description


@pytest.mark.isa
def test_openvino_precision_is_pinned_and_read_back(onnx_model):
    """The plugin picks bf16 on its own on bf16 CPUs; servopt pins what the variant asks for and reads back what ran."""
    if not get_runtime("openvino").available()[0]:
        pytest.skip("openvino not installed")
    from servopt.machine import host_features

    artifact = Artifact(format="onnx", path=str(onnx_model))
    fp32 = open_session(artifact, "openvino", {"precision": "fp32"}).info()
    assert fp32.precision_requested == "fp32" and fp32.details["inference_precision_hint"] == "f32"
    bf16 = open_session(artifact, "openvino", {"precision": "bf16"}).info()
    assert bf16.precision_requested == "bf16"
    cpu = host_features()  # what the plugin sees, whatever servopt is told to read (SERVOPT_CPU_READ_AS)
    if cpu.bf16:
        assert bf16.details["inference_precision_hint"] == "bf16"
    elif "avx512f" in cpu.flags:
        # AVX-512 without AVX512-BF16 (an Intel Xeon whose hypervisor hides AMX and BF16, 2026-11-27): the plugin
        # emulates bf16 (its outputs differ from f32 at bf16's precision); what is read back is what ran
        assert bf16.details["inference_precision_hint"] in ("bf16", "f32")
    else:  # no bf16 arithmetic: the plugin runs f32 and says so (a bf16 variant then fails verification: ran_as_asked)
        assert bf16.details["inference_precision_hint"] == "f32"


class _LyingSession(Session):
    """Asks for fp32, runs bf16: what OpenVINO's default did here before servopt pinned it."""

    def __init__(self) -> None:
        self.input_names = ["input"]

    def run_prepared(self, prepared):
        return prepared["input"].mean(axis=(2, 3))

    def info(self) -> SessionInfo:
        return SessionInfo(runtime="openvino", provider_requested="CPU", provider_actual="CPU", precision_requested="fp32",
                           precision_actual="bf16", details={"precision_source": "simulated"})


def test_a_precision_other_than_the_label_fails_verification():
    x = np.random.default_rng(0).standard_normal((8, 3, 8, 8)).astype(np.float32)
    data = Dataset({"input": x}, None, None, "t")
    measured = measure_session(_LyingSession(), data, x.mean(axis=(2, 3)), FAMILIES.get("image-classification"), Protocol.quick())
    assert measured.status == "failed" and "asked for fp32 but openvino runs bf16" in measured.error
    assert measured.latency_ms is None, "never timed"


def test_isa_caps_are_runtime_facts():
    assert get_runtime("onnxruntime").isa_cap_env("avx2") is None, "MLAS picks its kernels from cpuid: no cap"
    assert get_runtime("openvino").isa_cap_env("avx2") == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert get_runtime("torch").isa_cap_env("avx2") == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.slow  # over a second: `make test` runs it
def test_an_isa_capped_measurement_records_the_cap(onnx_model, tmp_path):
    """A job run under the cap records it in its environment, and OpenVINO's kernels read back show the capped path."""
    if not get_runtime("openvino").available()[0]:
        pytest.skip("openvino not installed")
    from servopt.bench.jobs import MeasureJob, OpenSpec
    from servopt.bench.launcher import launch

    x = np.random.default_rng(0).standard_normal((8, 3, 8, 8)).astype(np.float32)
    Dataset({"input": x}, None, None, "t").save(tmp_path / "d.npz")
    job = MeasureJob(session=OpenSpec(name="ov", artifact=Artifact(format="onnx", path=str(onnx_model)), runtime="openvino"),
                     data=str(tmp_path / "d.npz"), family="image-classification", protocol=Protocol.quick(),
                     env=get_runtime("openvino").isa_cap_env("avx2"))
    measured = launch(job, tmp_path / "job").result
    assert measured is not None and measured.status == "ok"
    assert measured.environment.isa_cap == "AVX2"
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in (tmp_path / "job" / "replay.sh").read_text()


def test_a_variant_that_cannot_run_on_the_target_isa_fails_that_bound():
    """OpenVINO bf16 under an AVX2 cap does not even compile: the target cannot run it, and the verdict says so."""
    from servopt.contracts import Accuracy, ClassificationQuality, Environment, Interleaved, Latency, Record, Throughput
    from servopt.optimize.decide import judge
    from servopt.optimize.targets import PRESETS

    rec = Record(name="ov-bf16-latency", runtime="openvino", status="ok", size_mb=9, latency_ms=Latency(p50=1), throughput_ips=Throughput(batch=2000),
                 quality=ClassificationQuality(accuracy=Accuracy(top1=0.95, top5=1, correct=1, total=1)), environment=Environment(cpu="EPYC", cpu_flags=["avx512_bf16"]))
    capped = Interleaved(reference="ort-fp32", rounds=1, order=[], variants={}, failed={"ov-bf16-latency": "OpenVINO cannot load …"},
                         environment=Environment(cpu="EPYC", isa_cap="AVX2"))
    verdict = judge(PRESETS["cpu-server"], rec, rec, FAMILIES.get("image-classification"), capped)
    bound = next(b for b in verdict.bounds if b.bound == "runs_on_target_isa")
    assert not verdict.passes and bound.status == "fail" and "capped at AVX2" in bound.note


def test_a_record_names_the_rung_its_cpu_reached():
    """``Environment.isa``: the measuring CPU's rung, from the flags the record carries (never this machine's)."""
    from servopt.contracts import Environment

    assert Environment(cpu="EPYC 7763", cpu_flags=["avx2", "fma"]).isa == "avx2"
    assert Environment(cpu="Xeon", cpu_flags=sorted(SAPPHIRE.flags)).isa == "amx"
    assert Environment(cpu="Graviton", cpu_flags=["asimd", "asimddp"]).isa == "arm"
