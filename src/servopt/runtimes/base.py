"""The runtime interface and registry: a new backend is one file that registers itself.

A ``Runtime`` opens an artifact (an ONNX file, a torch model reference, an
OpenVINO model) with options and returns a ``Session``. Sessions split input
preparation from execution so the benchmark times only execution.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from servopt.errors import UserError
from servopt.registry import Registry


class Session(ABC):
    """A loaded model ready to run. ``run`` returns the first output as NumPy."""

    input_names: list[str]

    def prepare(self, feed: dict[str, np.ndarray]) -> Any:
        """Convert inputs to the runtime's native form (done before timing)."""
        return feed

    @abstractmethod
    def run_prepared(self, prepared: Any) -> Any:
        """Execute on prepared inputs; the benchmark times exactly this call."""

    def to_numpy(self, output: Any) -> np.ndarray:
        return np.asarray(output)

    def run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        return self.to_numpy(self.run_prepared(self.prepare(feed)))

    @abstractmethod
    def info(self) -> dict:
        """What actually ran: provider/device, threads, settings. Reported with every figure."""


class Runtime(ABC):
    name: ClassVar[str]
    artifact_formats: ClassVar[tuple[str, ...]]  # which artifact formats it opens
    needs_gpu: ClassVar[bool] = False

    @abstractmethod
    def open(self, artifact: dict, options: dict) -> Session: ...

    def validate_options(self, options: dict) -> None:
        """Raise ``UserError`` for a bad option before any process is started."""

    def available(self) -> tuple[bool, str]:
        """Whether this machine can run it, and why not."""
        return True, ""


RUNTIMES: Registry[Runtime] = Registry("runtime", "servopt.runtimes")
register_runtime = RUNTIMES.register
get_runtime = RUNTIMES.get


def open_session(artifact: dict, runtime: str, options: dict | None = None) -> Session:
    rt = get_runtime(runtime)
    if artifact["format"] not in rt.artifact_formats:
        raise UserError(f"runtime {runtime} cannot open a {artifact['format']} artifact", fix=f"it opens {rt.artifact_formats}")
    return rt.open(artifact, options or {})
