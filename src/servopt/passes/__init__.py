"""Passes, registered by name. Importing this package registers the built-ins."""

from servopt.passes import (  # noqa: F401
    accuracy_aware,
    calibration_search,
    equalize,
    nncf_onnx,
    onnx_passes,
    openvino_passes,
    torch_passes,
)
from servopt.passes.base import PASSES, BuildContext, Pass, build_chain, get_pass, register_pass, source_artifact

__all__ = ["PASSES", "BuildContext", "Pass", "build_chain", "get_pass", "register_pass", "source_artifact"]
