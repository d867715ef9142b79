"""OpenVINO on the CPU, with its LATENCY / THROUGHPUT performance hints."""

from __future__ import annotations

import numpy as np

from servopt.errors import UserError
from servopt.runtimes.base import Runtime, Session, register_runtime


class OpenVinoSession(Session):
    def __init__(self, artifact: dict, options: dict) -> None:
        import openvino as ov

        core = ov.Core()
        self.options = options
        config = {"PERFORMANCE_HINT": options.get("hint", "LATENCY")}
        if options.get("threads"):
            config["INFERENCE_NUM_THREADS"] = int(options["threads"])
        try:
            model = core.read_model(artifact["path"])
            self.compiled = core.compile_model(model, "CPU", config)
        except Exception as e:
            raise UserError(f"OpenVINO cannot load {artifact['path']}: {str(e).splitlines()[0]}", fix="check the model") from e
        self.request = self.compiled.create_infer_request()
        self.input_names = [i.get_any_name() for i in self.compiled.inputs]
        self.output = self.compiled.outputs[0]

    def run_prepared(self, prepared: dict[str, np.ndarray]) -> np.ndarray:
        # share_inputs avoids a copy; the outputs are copied out so callers may keep them.
        return np.array(self.request.infer(prepared, share_inputs=True)[self.output])

    def info(self) -> dict:
        return {
            "runtime": "openvino",
            "provider_requested": "CPU",
            "provider_actual": "CPU",
            "provider_fallback": False,
            "hint": self.options.get("hint", "LATENCY"),
            "streams": int(self.compiled.get_property("NUM_STREAMS")),
        }


@register_runtime
class OpenVinoRuntime(Runtime):
    name = "openvino"
    artifact_formats = ("onnx", "openvino")

    def available(self) -> tuple[bool, str]:
        try:
            import openvino  # noqa: F401
        except ImportError:
            return False, "openvino is not installed (pip install servopt[openvino])"
        return True, ""

    def open(self, artifact: dict, options: dict) -> Session:
        ok, why = self.available()
        if not ok:
            raise UserError(why, fix="pip install 'servopt[openvino]'")
        return OpenVinoSession(artifact, options)
