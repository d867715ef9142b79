"""Passes, registered by name. Importing this package registers the built-ins."""

from servopt.passes import accuracy_aware, onnx_passes, openvino_passes, torch_passes  # noqa: F401
from servopt.passes.base import PASSES, BuildContext, Pass, build_chain, get_pass, register_pass, source_artifact

__all__ = ["PASSES", "BuildContext", "Pass", "build_chain", "get_pass", "register_pass", "source_artifact"]
