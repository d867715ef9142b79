"""A peer: one tool a user would reach for instead of servopt (NNCF, sentence-transformers, Intel Neural Compressor …).

A peer is one file in ``peers/builtin/`` (or a plugin module) with a ``Peer`` subclass decorated by ``@register_peer``:

- ``families``: the model families it applies to; ``requirements`` (pinned) and ``environment()``, an ``EnvSpec`` when
  it cannot share servopt's environment (``envs.ensure_env`` makes it once; its build job runs there);
- ``available(inputs)``: whether it can run here, and why not — a peer that cannot is listed with the reason, never
  faked; cheap (no environment is made for it);
- ``build(inputs)``: its answer for the run's model from the run's data, run in a fresh process (``jobs.PeerBuildJob``)
  in its environment, returning a ``PeerAnswer``: an artifact that servopt's own runtimes open, so its measurement
  is the same protocol in the same kind of process as the pick's, and what it ran (tool, version, call);
- ``serves`` and ``serve(inputs, answer, python)``: a peer with a server of its own (Infinity) starts it on its answer
  and hands back a ``Server`` (URL, model name, API, ``stop``); the served scenarios load it against servopt's pick
  under ``servopt serve``. An answer only its own server runs is ``PeerAnswer(offline=False)``.
- ``encodes`` and ``encoder(inputs, answer)``: a peer with a text path of its own (sentence-transformers' ``encode``)
  hands back texts → embeddings as its users call it (its tokenizer, batching and pooling), loaded in a fresh process
  in its environment; the texts scenarios (``scenarios/texts.py``) time it against servopt's own text path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from servopt.contracts import Artifact, Contract
from servopt.envs import EnvSpec
from servopt.registry import Registry
from servopt.spec import ModelSpec

# servopt's ONNX Runtime options for a session as ONNX Runtime ships it: every fusion on (servopt's own sessions leave
# out the ones its CPU provider runs slower, ``runtimes.onnxruntime_runtime.CPU_SLOW_FUSIONS``), its own thread count.
ORT_AS_SHIPPED: dict[str, Any] = {"cpu_slow_fusions": True}


class PeerUnavailable(Exception):
    """Raised by a build that finds it cannot run here (a library missing, a hub it would need): listed, not failed."""


class PeerInputs(Contract):
    """What a peer builds from (crosses into its build process): the run's model, as its original and its fp32 ONNX
    file, and the run's data files (``Dataset`` .npz), the same ones servopt's own variants were built and judged on."""

    peer: str
    run_dir: str
    family: str
    spec: ModelSpec
    original: Artifact  # the run's original (an ONNX file, or a torch source's ref)
    onnx: str | None = None  # the run's fp32 ONNX model: the original when it is ONNX, else the run's export
    calibration: str | None = None  # data/calib.npz: what servopt's static INT8 calibrated on
    tuning: str | None = None  # data/tune.npz: what servopt's choices were made on (never the evaluation samples)
    evaluation: str  # data/eval.npz: held out; peers judge nothing on it
    out: str  # the peer's own folder for what it builds
    quick: bool = False  # a smoke run: the least work that still builds a real answer
    isa: str | None = None  # the compared target's instruction set (cpu.Isa), None: this CPU's

    @property
    def out_dir(self) -> Path:
        return Path(self.out)


class PeerAnswer(Contract):
    """What a peer built: the artifact a servopt runtime opens as the peer would run it, and what ran to build it."""

    artifact: Artifact
    runtime: str = "onnxruntime"
    options: dict[str, Any] = Field(default_factory=dict)  # the runtime's options that reproduce the peer's own session
    configuration: dict[str, Any] = Field(default_factory=dict)  # tool, version, call, what it could not do here
    build_s: float | None = None
    offline: bool = True  # measured by servopt's runtimes (single, offline); False: its artifact is only served by its tool


ServedApi = Literal["oip-v2", "openai-embeddings"]
Encode = Callable[[list[str], int], Any]  # texts, batch size → their embeddings (an array [texts, dimensions])


@dataclass
class Server:
    """A running server a served scenario loads (a peer's, or servopt's pick under ``servopt serve``): where to send
    requests, the model name they carry, the API it speaks, and how to stop it (``stop`` is called once)."""

    url: str
    model: str
    stop: Callable[[], None]
    api: ServedApi = "oip-v2"
    pid: int | None = None
    command: list[str] = field(default_factory=list)
    start_s: float | None = None  # process start to ready


class Peer:
    """One tool a user would use instead; see the module docstring."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    families: ClassVar[tuple[str, ...]] = ()  # the model families it applies to
    requirements: ClassVar[tuple[str, ...]] = ()  # pinned; installed in its own environment when environment() says so
    serves: ClassVar[ServedApi | None] = None  # the API of its own server (served scenarios measure it); None: it has none
    encodes: ClassVar[bool] = False  # it has a text path of its own (``encoder``): the texts scenarios time it

    def environment(self) -> EnvSpec | None:
        """Its own Python environment (None: it runs in servopt's)."""
        return None

    def available(self, inputs: PeerInputs) -> tuple[bool, str]:
        """(can it run here, why not): the family, the inputs it needs, its libraries. Cheap: makes no environment."""
        return self.applies(inputs)

    def applies(self, inputs: PeerInputs) -> tuple[bool, str]:
        if self.families and inputs.family not in self.families:
            return False, f"it applies to {', '.join(self.families)} models, and this run's model is {inputs.family}"
        return True, ""

    def needs(self, inputs: PeerInputs, *, onnx: bool = False, calibration: bool = False, tuning: bool = False) -> tuple[bool, str]:
        """``applies``, and the run has the inputs the peer builds from: its fp32 ONNX model, its calibration and
        tuning samples."""
        ok, why = self.applies(inputs)
        if ok and onnx and inputs.onnx is None:
            return False, "the run has no fp32 ONNX model (the original, or its ort-fp32 export) to start from"
        for wanted, have, what in ((calibration, inputs.calibration, "calibration samples (data/calib.npz)"),
                                   (tuning, inputs.tuning, "tuning samples (data/tune.npz)")):
            if ok and wanted and have is None:
                return False, f"the run saved no {what}"
        return ok, why

    def needs_hf_folder(self, inputs: PeerInputs, what: str) -> tuple[bool, str]:
        """``applies``, and the run's original is a Hugging Face folder (``what`` the tool does with one: says why not)."""
        ok, why = self.applies(inputs)
        ref = inputs.original.ref
        if ok and (ref is None or ref.kind != "hf_encoder"):
            return False, f"it {what} a Hugging Face model folder, and this run's model is not one"
        return ok, why

    def own_environment(self, name: str | None = None) -> EnvSpec:
        """An environment of its own with its ``requirements``, servopt's core and servopt's ONNX Runtime version (what
        builds or calibrates its model is what measures it); ``name``: another peer's, to share it (same requirements)."""
        from importlib import metadata

        from servopt.envs import runtime_spec

        return runtime_spec(f"peer-{name or self.name}", [*self.requirements, f"onnxruntime=={metadata.version('onnxruntime')}"])

    def build(self, inputs: PeerInputs) -> PeerAnswer:
        """Its answer for the model (in its own process and environment); ``PeerUnavailable`` when it cannot run here."""
        raise NotImplementedError

    def serve(self, inputs: PeerInputs, answer: PeerAnswer, python: Path) -> Server:
        """Start its own server on ``answer`` (``serves`` names its API), ready when it returns: called in the comparing
        process, once per round; ``python`` is its environment's interpreter (servopt's when it has none)."""
        raise NotImplementedError(f"{self.name} has no server of its own")

    def encoder(self, inputs: PeerInputs, answer: PeerAnswer) -> Encode:
        """Texts in, embeddings out as the tool's users call it (``encodes`` says it has one): loaded once in a fresh
        process in its environment, then ``encode(texts, batch_size)`` → an array [texts, dimensions]."""
        raise NotImplementedError(f"{self.name} has no text path of its own")


def copy_hf_folder(inputs: PeerInputs, name: str) -> Path:
    """The run's Hugging Face folder copied afresh to ``<peer out>/<name>`` without its exported models (ONNX, OpenVINO):
    a tool that exports the folder writes its own there, as a user's first run does."""
    import shutil

    assert inputs.original.ref is not None
    folder = inputs.out_dir / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(inputs.original.ref.path, folder, ignore=shutil.ignore_patterns("onnx", "openvino", "*.onnx"))
    return folder


PEERS: Registry[Peer] = Registry("peer", "servopt.peers.builtin")


def register_peer(cls: type[Peer]) -> type[Peer]:
    return PEERS.register(cls)


def importable(*modules: str) -> tuple[bool, str]:
    """Whether ``modules`` import here without importing them (find_spec): a peer's cheap availability check."""
    from importlib.util import find_spec

    missing = []
    for m in modules:
        try:
            if find_spec(m) is None:
                missing.append(m)
        except (ImportError, ValueError):
            missing.append(m)
    return (not missing, f"{', '.join(missing)} not installed" if missing else "")
