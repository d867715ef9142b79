"""OpenVINO on the CPU, with its LATENCY / THROUGHPUT performance hints."""

from __future__ import annotations

import itertools

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
        self.queue = None
        if config["PERFORMANCE_HINT"] == "THROUGHPUT":
            # The THROUGHPUT hint splits the CPU into streams that only parallel requests can fill: a batch is cut
            # into one slice per stream and run through an AsyncInferQueue (one synchronous request uses one stream).
            self.queue = ov.AsyncInferQueue(self.compiled, int(self.compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")))

    def run_prepared(self, prepared: dict[str, np.ndarray]) -> np.ndarray:
        n = len(next(iter(prepared.values())))
        if self.queue is None or n < 2 or len(self.queue) < 2:
            # share_inputs avoids a copy; the outputs are copied out so callers may keep them.
            return np.array(self.request.infer(prepared, share_inputs=True)[self.output])
        bounds = np.linspace(0, n, min(len(self.queue), n) + 1).astype(int)
        parts: dict[int, np.ndarray] = {}
        self.queue.set_callback(lambda request, index: parts.__setitem__(index, np.array(request.get_output_tensor(0).data)))
        for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            self.queue.start_async({k: v[lo:hi] for k, v in prepared.items()}, userdata=i, share_inputs=True)
        self.queue.wait_all()
        return np.concatenate([parts[i] for i in range(len(bounds) - 1)])

    def info(self) -> dict:
        return {
            "runtime": "openvino",
            "provider_requested": "CPU",
            "provider_actual": "CPU",
            "provider_fallback": False,
            "hint": self.options.get("hint", "LATENCY"),
            "streams": int(self.compiled.get_property("NUM_STREAMS")),
            "parallel_requests": len(self.queue) if self.queue is not None else 1,
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
