"""Runtimes, registered by name. Importing this package registers the built-ins;
each imports its framework only when a session is opened."""

from servopt.runtimes import onnxruntime_openvino, onnxruntime_runtime, openvino_runtime, torch_runtime  # noqa: F401
from servopt.runtimes.base import (
    RUNTIMES,
    Runtime,
    RuntimeOptions,
    Session,
    all_libraries,
    get_runtime,
    open_session,
    register_runtime,
)

__all__ = ["RUNTIMES", "Runtime", "RuntimeOptions", "Session", "all_libraries", "get_runtime", "open_session", "register_runtime"]
