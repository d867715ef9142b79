"""What a pass builds and a runtime opens (``ModelRef``, ``Artifact``) and what a runtime says actually ran (``SessionInfo``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from servopt.contracts.base import Contract
from servopt.spec import ModelSpec


class ModelRef(Contract):
    """Everything another process needs to load a source model again."""

    kind: str  # onnx | torchscript | exported_program | state_dict | pickle | hf_encoder
    path: str
    arch: str | None = None
    num_classes: int | None = None
    trust_pickle: bool = False
    spec: ModelSpec


class Artifact(Contract):
    """A model a runtime can open: an ONNX file, an OpenVINO IR, or a reference to a torch source."""

    format: Literal["onnx", "openvino", "torch"]
    path: str | None = None  # the file to open (onnx, openvino)
    ref: ModelRef | None = None  # torch: how to load the source module
    size_file: str | None = None  # torch: a file saved to measure the variant's size on disk
    hash: str | None = None  # content hash of the source + chain, for the build cache
    # A digest of the calibration and tuning data the chain's passes may read (``passes.base.build_data_key``): part of
    # the cache key of every step that reads data, so other data (or another sample count) builds anew.
    data_key: str | None = None
    built_by: str | None = None  # the pass that produced it
    params: dict[str, Any] | None = None  # that pass's parameters, defaults filled in
    report: dict[str, Any] | None = None  # that pass's build report (e.g. the accuracy-aware search)

    def opened(self) -> Artifact:
        """The same artifact without its build report: what a measuring process needs."""
        return self.model_copy(update={"report": None})


class SessionInfo(Contract):
    """What ACTUALLY ran, read back from the runtime after loading (never assumed from the request)."""

    runtime: str
    provider_requested: str
    provider_actual: str
    provider_fallback: bool = False
    precision_requested: str | None = None  # what the variant asked for: fp32, bf16, fp16, int8
    precision_actual: str | None = None  # what the runtime reports it runs
    threads: int | str | None = None
    details: dict[str, Any] = Field(default_factory=dict)  # runtime-specific: graph level, hint, streams, mode …
