"""Records say what ran: a provider that fell back or a precision other than the one asked for fails verification, for
every runtime, and each runtime reads both back from what it loaded (never from the options it was given).

No GPU and no onnxruntime-gpu here: onnxruntime-gpu's behaviour on a machine without a GPU (it lists CUDA and TensorRT,
then runs on the CPU without saying so) is simulated by patching what ``onnxruntime`` answers."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import onnxruntime
import pytest

from conftest import TinyNet, channel_mean_onnx
from servopt.bench.protocol import Protocol, measure_session, ran_as_asked
from servopt.contracts import Artifact
from servopt.data.dataset import Dataset
from servopt.errors import UserError
from servopt.families import FAMILIES
from servopt.runtimes import get_runtime
from servopt.runtimes.onnxruntime_runtime import TRT, graph_precision

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
REAL_SESSION = onnxruntime.InferenceSession
IMAGES = FAMILIES.get("image-classification")


@pytest.fixture(scope="module")
def colour_onnx(tmp_path_factory) -> Path:
    return channel_mean_onnx(tmp_path_factory.mktemp("ran") / "m.onnx", size=8)


@pytest.fixture(scope="module")
def data() -> Dataset:
    x = np.random.default_rng(0).standard_normal((8, 3, 8, 8)).astype(np.float32)
    return Dataset({"input": x}, None, None, "t")


def _open(runtime: str, path: Path, options: dict):
    rt = get_runtime(runtime)
    return rt.open(Artifact(format="onnx", path=str(path)), rt.parse_options(options))  # open() itself: no GPU check


def _measure(session, data: Dataset):
    session.warm_up(data.slice(0, 1))
    return measure_session(session, data, data.inputs["input"].mean(axis=(2, 3)), IMAGES, Protocol.quick())


def test_a_provider_that_fell_back_fails_verification(colour_onnx, data):
    """Asked for CUDA, ran on the CPU: recorded failed with the provider that ran and the one asked for, never timed."""
    session = _open("onnxruntime", colour_onnx, {"providers": [CUDA, CPU]})
    info = session.info()
    assert info.provider_fallback and info.provider_requested == CUDA and info.provider_actual == CPU
    measured = _measure(session, data)
    assert measured.status == "failed" and measured.latency_ms is None
    assert f"asked for {CUDA} but onnxruntime ran on {CPU}" in measured.error
    assert measured.quality is not None and measured.quality.agreement is not None, "the figures it has are kept"
    assert ran_as_asked(_open("onnxruntime", colour_onnx, {}).info()) is None


class _GpuBuild:
    """``onnxruntime-gpu`` as installed here: it lists TensorRT and CUDA; a session then runs on whatever ``ran`` says
    (the CPU where no GPU exists), reporting ``ran_options``. The model itself runs on ONNX Runtime's CPU provider."""

    ran: ClassVar[list[str]] = [CPU]
    ran_options: ClassVar[dict[str, dict[str, str]]] = {}
    asked: ClassVar[list] = []

    def __init__(self, path, sess_options=None, providers=None, disabled_optimizers=None) -> None:
        type(self).asked = list(providers or [])
        self.real = REAL_SESSION(path, sess_options=sess_options, providers=[CPU], disabled_optimizers=disabled_optimizers)

    def get_providers(self) -> list[str]:
        return list(self.ran)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {p: self.ran_options.get(p, {}) for p in self.ran}

    def __getattr__(self, name: str):
        return getattr(self.real, name)


@pytest.fixture
def gpu_build(monkeypatch):
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: [TRT, CUDA, CPU])
    monkeypatch.setattr(onnxruntime, "InferenceSession", _GpuBuild)
    monkeypatch.setattr(_GpuBuild, "ran", [CPU])
    monkeypatch.setattr(_GpuBuild, "ran_options", {})
    return _GpuBuild


TRT_FP16 = {"providers": [TRT, CUDA], "trt_fp16": True}


def test_tensorrt_fp16_is_asked_of_tensorrt_and_a_cpu_fallback_fails(colour_onnx, data, gpu_build):
    session = _open("onnxruntime-cuda", colour_onnx, TRT_FP16)
    assert gpu_build.asked[0] == (TRT, {"trt_fp16_enable": True}), "FP16 really asked of TensorRT"
    assert gpu_build.asked[1] == CUDA
    info = session.info()
    assert info.provider_fallback and info.precision_requested == "fp16" and info.precision_actual == "fp32"
    measured = _measure(session, data)
    assert measured.status == "failed" and measured.latency_ms is None
    assert f"asked for {TRT} but onnxruntime ran on {CPU}" in measured.error
    assert "asked for fp16 but onnxruntime runs fp32" in measured.error


def test_tensorrt_fp16_is_read_back_from_the_provider_that_ran(colour_onnx, gpu_build, monkeypatch):
    monkeypatch.setattr(gpu_build, "ran", [TRT, CUDA, CPU])
    monkeypatch.setattr(gpu_build, "ran_options", {TRT: {"trt_fp16_enable": "1", "device_id": "0"}, CUDA: {"device_id": "0"}})
    info = _open("onnxruntime-cuda", colour_onnx, TRT_FP16).info()
    assert not info.provider_fallback and info.precision_actual == "fp16 (TensorRT)"
    assert info.details["provider_options"][TRT]["trt_fp16_enable"] == "1"
    assert ran_as_asked(info) is None
    # TensorRT ran, but without FP16 (an option the build ignored): the record says fp32 and verification fails.
    monkeypatch.setattr(gpu_build, "ran_options", {TRT: {"trt_fp16_enable": "0"}})
    info = _open("onnxruntime-cuda", colour_onnx, TRT_FP16).info()
    assert info.precision_actual == "fp32" and "asked for fp16 but onnxruntime runs fp32" in ran_as_asked(info)


def test_tensorrt_int8_is_asked_of_tensorrt_and_read_back(graphs, gpu_build, monkeypatch):
    """A calibrated QDQ graph on TensorRT with its INT8 kernels (explicit quantization): asked of TensorRT, read back
    from the options it ran with; a CPU fallback runs the graph on ORT's CPU kernels and says which ran."""
    options = {"providers": [TRT, CUDA], "trt_int8": True, "trt_fp16": True}
    monkeypatch.setattr(gpu_build, "ran", [TRT, CUDA, CPU])
    monkeypatch.setattr(gpu_build, "ran_options", {TRT: {"trt_int8_enable": "1", "trt_fp16_enable": "1"}})
    info = _open("onnxruntime-cuda", graphs["qdq"], options).info()
    assert gpu_build.asked[0] == (TRT, {"trt_fp16_enable": True, "trt_int8_enable": True})
    assert info.precision_requested == "int8" and info.precision_actual == "int8 (TensorRT, QDQ)" and ran_as_asked(info) is None
    monkeypatch.setattr(gpu_build, "ran", [CPU])
    fell_back = _open("onnxruntime-cuda", graphs["qdq"], options).info()
    assert "asked for TensorrtExecutionProvider but onnxruntime ran on CPUExecutionProvider" in ran_as_asked(fell_back)
    assert fell_back.precision_actual == "int8 (QDQ, 3/3 heavy ops)", "ORT's CPU kernels read from the profile"
    with pytest.raises(UserError, match="trt_int8"):
        _open("onnxruntime-cuda", graphs["qdq"], {"trt_int8": True})


def test_tensorrt_fp16_without_tensorrt_is_refused(colour_onnx, gpu_build):
    with pytest.raises(UserError, match="trt_fp16"):
        _open("onnxruntime-cuda", colour_onnx, {"trt_fp16": True})


@pytest.fixture(scope="module")
def graph_files(tmp_path_factory) -> dict[str, Path]:
    """One tiny conv + linear model as fp32, fp16, and INT8 in each ONNX Runtime format."""
    import onnx
    import torch
    from onnx import numpy_helper
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static

    tmp = tmp_path_factory.mktemp("graphs")
    net = TinyNet.build()
    fp32 = tmp / "fp32.onnx"
    torch.onnx.export(net, (torch.zeros(1, 3, 32, 32),), str(fp32), dynamo=False, input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}})

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.items = iter([{"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.items, None)

    out = {"fp32": fp32}
    for name, fmt in (("qdq", QuantFormat.QDQ), ("qoperator", QuantFormat.QOperator)):
        out[name] = tmp / f"{name}.onnx"
        quantize_static(str(fp32), str(out[name]), Reader(), quant_format=fmt, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8)
    out["dynamic"] = tmp / "dynamic.onnx"
    quantize_dynamic(str(fp32), str(out["dynamic"]), weight_type=QuantType.QInt8)
    model = onnx.load(str(fp32))  # fp16 weights behind a Cast, as a half-size model keeps them
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    out["fp16"] = tmp / "fp16.onnx"
    onnx.save(model, str(out["fp16"]))
    return out


@pytest.fixture(scope="module")
def graphs(tmp_path_factory, graph_files) -> dict[str, Path]:
    """``graph_files`` and the fp16 pass's runnable graph (fp16 weights and compute, float32 inputs and outputs)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    path = tmp_path_factory.mktemp("fp16") / "fp16-cast.onnx"
    onnx.save(convert_float_to_float16(onnx.load(str(graph_files["fp32"])), keep_io_types=True), str(path))
    return {**graph_files, "fp16-cast": path}


def test_the_graph_says_its_precision_and_int8_format(graph_files):
    assert {k: graph_precision(str(p)) for k, p in graph_files.items()} == {
        "fp32": "fp32", "fp16": "fp16", "qdq": "int8 (QDQ)", "qoperator": "int8 (QOperator)", "dynamic": "int8 (dynamic)"}


@pytest.mark.parametrize(("graph", "asked", "mismatch"), [
    ("qdq", "int8", False), ("qoperator", "int8", False), ("dynamic", "int8", False), ("fp32", "fp32", False),
    ("fp32", "int8", True),  # a quantizer that left the graph in float
    ("fp32", "fp16", True),  # an fp16 pass that changed nothing
    ("qdq", "fp32", True),  # an INT8 model timed as a float one
])
def test_an_onnxruntime_precision_other_than_asked_fails(graphs, graph, asked, mismatch):
    info = _open("onnxruntime", graphs[graph], {"precision": asked}).info()
    problem = ran_as_asked(info)
    assert (problem is not None) == mismatch, problem
    if mismatch:
        assert f"asked for {asked} but onnxruntime runs {info.precision_actual}" in problem


def test_int8_is_read_from_the_kernels_that_ran(graphs, images):
    """ONNX Runtime fuses a QDQ graph's DQ → Conv → Q into integer kernels only when its graph optimizer runs: left
    unfused (ORT_DISABLE_ALL), every convolution and the Gemm run in float between Q/DQ pairs, which the graph's own
    operators cannot tell. The read-back says float and an INT8 variant fails verification; a QOperator graph has its
    integer kernels in the file and reads back INT8 at any graph level."""
    unfused = _open("onnxruntime", graphs["qdq"], {"precision": "int8", "graph_optimization_level": "disable"})
    unfused.warm_up(images.slice(0, 1))
    info = unfused.info()
    assert info.details["graph_precision"] == "int8 (QDQ)", "the file alone still says INT8"
    assert info.precision_actual == "fp32 (INT8 QDQ graph: 3/3 heavy ops ran in fp32 kernels)"
    assert info.details["kernels"] == {"fp32": {"ops": 3, "share": 1.0}}
    measured = measure_session(unfused, images, unfused.run(images.inputs), IMAGES, Protocol.quick())
    assert measured.status == "failed" and measured.latency_ms is None
    assert "asked for int8 but onnxruntime runs fp32 (INT8 QDQ graph" in measured.error
    assert "the kernels ONNX Runtime's profiler saw run" in measured.error

    fused = _open("onnxruntime", graphs["qdq"], {"precision": "int8"}).info()  # ORT_ENABLE_ALL: QLinearConv, QGemm
    assert fused.precision_actual == "int8 (QDQ, 3/3 heavy ops)" and ran_as_asked(fused) is None
    for level in ("disable", "all"):
        qop = _open("onnxruntime", graphs["qoperator"], {"precision": "int8", "graph_optimization_level": level}).info()
        assert qop.precision_actual == "int8 (QOperator, 3/3 heavy ops)" and ran_as_asked(qop) is None
    dynamic = _open("onnxruntime", graphs["dynamic"], {"precision": "int8"}).info()
    assert dynamic.precision_actual == "int8 (dynamic, 3/3 heavy ops)"


def test_an_fp16_graph_computed_through_casts_reads_back_float(graphs, images):
    """The fp16 pass's graph (fp16 weights, float32 inputs kept): where the CPU provider has no fp16 kernel for a
    convolution or a matrix product it inserts casts and computes in float32, which the read-back says, so a variant
    asking for fp16 fails; where it has them (the input type the profiler saw is float16) fp16 is what ran."""
    session = _open("onnxruntime", graphs["fp16-cast"], {"precision": "fp16"})
    session.warm_up(images.slice(0, 1))
    info = session.info()
    kernels = info.details["kernels"]
    assert info.details["graph_precision"] == "fp16" and sum(k["ops"] for k in kernels.values()) == 3
    if "fp16" not in kernels:  # every CPU this was written on: no fp16 Conv/Gemm kernel in ORT's CPU provider
        assert info.precision_actual == "fp32 (fp16 graph: 3/3 heavy ops ran in fp32 kernels)"
        assert "asked for fp16 but onnxruntime runs fp32 (fp16 graph" in ran_as_asked(info)
    else:
        assert info.precision_actual.startswith("fp16") and ran_as_asked(info) is None


def test_the_kernels_read_back_and_their_share():
    """What a profile says, classified: integer kernels are INT8 whatever their inputs, others by their input type;
    the precision holding most of the heavy ops' kernel time is what ran, with its share where not all."""
    from servopt.runtimes.onnxruntime_runtime import kernels_ran, precision_from_kernels

    def node(op: str, dur: int, dtype: str = "float") -> dict:
        return {"cat": "Node", "name": f"{op}_kernel_time", "dur": dur,
                "args": {"op_name": op, "input_type_shape": [{dtype: [1, 8]}]}}

    events = [node("MatMulInteger", 60, "uint8"), node("DynamicQuantizeMatMul", 20), node("MatMul", 20), node("Add", 999),
              {"cat": "Session", "name": "model_loading_uri", "dur": 5000}, node("Conv", 0, "float16")]
    kernels = kernels_ran(events + events, runs=2)
    assert kernels == {"int8": {"ops": 2, "share": 0.8}, "fp32": {"ops": 1, "share": 0.2}, "fp16": {"ops": 1, "share": 0.0}}
    assert precision_from_kernels("int8 (dynamic)", kernels) == "int8 (dynamic, 2/4 heavy ops, 80% of their time)"
    assert precision_from_kernels("int8 (QDQ)", {"fp32": {"ops": 2, "share": 0.7}, "int8": {"ops": 3, "share": 0.3}}) == (
        "fp32 (INT8 QDQ graph: 2/5 heavy ops, 70% of their time ran in fp32 kernels)")
    assert precision_from_kernels("fp32", {"fp32": {"ops": 4, "share": 1.0}}) == "fp32"
    assert precision_from_kernels("fp32", {}) == "fp32", "no heavy op: the graph's precision"


def test_openvino_reads_an_int8_model_as_asking_for_int8(graphs):
    """The precision option pins OpenVINO's float layers; a quantized model asks for INT8 compute layers, and a
    QDQ model that OpenVINO ran in float would fail (here it runs INT8)."""
    if not get_runtime("openvino").available()[0]:
        pytest.skip("openvino is not installed here")
    info = get_runtime("openvino").open(Artifact(format="onnx", path=str(graphs["qdq"])),
                                        get_runtime("openvino").parse_options({"precision": "fp32"})).info()
    assert info.precision_requested == "int8" and info.details["float_precision"] == "fp32"
    assert info.precision_actual == "int8" and ran_as_asked(info) is None


@pytest.mark.parametrize(("ran", "problem"), [(["OpenVINOExecutionProvider", CPU], None), ([CPU], "but onnxruntime-openvino ran on")])
def test_the_openvino_ep_says_its_precision_cannot_be_read(graphs, ran, problem):
    """The OpenVINO EP reports neither its options nor its compiled model, and profiles as one fused node: the record
    says unknown and why (it used to read the request back as what ran); a provider that fell back still fails."""
    from servopt.runtimes.onnxruntime_openvino import OrtOpenVinoOptions, OrtOpenVinoSession

    session = object.__new__(OrtOpenVinoSession)  # the EP lives in its own environment: only the read-back is tested
    session.path, session.options = str(graphs["qdq"]), OrtOpenVinoOptions()
    session.sess = type("EpSession", (), {"get_providers": lambda self: list(ran)})()
    info = session.info()
    assert info.precision_requested == "int8" and info.precision_actual == "unknown"
    assert "not readable" in info.details["precision_source"] and info.details["graph_precision"] == "int8 (QDQ)"
    assert (ran_as_asked(info) is None) if problem is None else problem in ran_as_asked(info)


# ------------------------------------------------------------------------------------------------------------ torch


@pytest.fixture(scope="module")
def tiny_pickle(tmp_path_factory) -> Artifact:
    """A plain nn.Module (conv, conv, linear): what autocast and dynamic INT8 act on."""
    import torch

    from servopt.models.sources import load_model

    path = tmp_path_factory.mktemp("torch") / "net.pt"
    torch.save(TinyNet.build(), str(path))
    return Artifact(format="torch", ref=load_model(path, trust_pickle=True, input_shape={"input": [1, 3, 32, 32]}).ref())


@pytest.fixture(scope="module")
def images() -> Dataset:
    x = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    return Dataset({"input": x}, None, None, "t")


def _torch(artifact: Artifact, options: dict, images: Dataset):
    rt = get_runtime("torch")
    session = rt.open(artifact, rt.parse_options(options))
    session.warm_up(images.slice(0, 1))
    return session


def test_torch_autocast_is_read_from_what_the_module_computed(tiny_pickle, images):
    info = _torch(tiny_pickle, {"dtype": "bf16", "autocast": True}, images).info()
    assert info.precision_actual == "bf16 (computed over fp32 weights)" and info.details["compute_ops"] == {"bf16": 3}
    assert ran_as_asked(info) is None
    cast = _torch(tiny_pickle, {"dtype": "bf16"}, images).info()
    assert cast.precision_actual == "bf16" and ran_as_asked(cast) is None
    assert _torch(tiny_pickle, {}, images).info().precision_actual == "fp32"


def test_an_autocast_that_did_not_apply_fails_verification(tiny_pickle, images, monkeypatch):
    """The options say bf16 autocast; the module computed in fp32 (here: the autocast context dropped): recorded failed."""
    import contextlib

    from servopt.runtimes.torch_runtime import TorchSession

    monkeypatch.setattr(TorchSession, "_context", lambda self: contextlib.nullcontext())
    session = _torch(tiny_pickle, {"dtype": "bf16", "autocast": True}, images)
    assert session.info().precision_actual == "fp32"
    measured = measure_session(session, images, session.run(images.inputs), IMAGES, Protocol.quick())
    assert measured.status == "failed" and "asked for bf16 but torch runs fp32" in measured.error


def test_torch_int8_is_read_from_the_module(tiny_pickle, images, tmp_path):
    info = _torch(tiny_pickle, {"quantize_dynamic": True}, images).info()
    assert info.precision_actual == "int8 (dynamic, 1 of 3 compute ops)" and ran_as_asked(info) is None
    # torch.export's module has no nn.Linear for quantize_dynamic to swap: it asks for INT8 and runs fp32.
    import torch

    from servopt.models.sources import load_model

    path = tmp_path / "net.pt2"
    torch.export.save(torch.export.export(TinyNet.build(), (torch.zeros(2, 3, 32, 32),),
                                          dynamic_shapes=({0: torch.export.Dim("batch")},)), str(path))
    exported = Artifact(format="torch", ref=load_model(path).ref())
    name = exported.ref.spec.inputs[0].name
    info = _torch(exported, {"quantize_dynamic": True}, Dataset({name: images.inputs["input"]}, None, None, "t")).info()
    assert info.precision_actual == "fp32" and "asked for int8 but torch runs fp32" in ran_as_asked(info)
