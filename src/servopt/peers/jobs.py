"""A peer's build in a fresh process, in the peer's own Python environment when it has one (``launcher.launch``:
its log, ``replay.sh`` and one failure shape, like every other job). ``runjob`` imports this module."""

from __future__ import annotations

import time
from typing import ClassVar, Literal

from servopt.bench.jobs import JobBase, register_job
from servopt.contracts import Contract
from servopt.peers.base import PeerAnswer, PeerInputs, PeerUnavailable
from servopt.peers.scenarios import texts as _texts  # noqa: F401  (registers the texts scenarios' job)


class PeerBuilt(Contract):
    """A build's outcome: the answer, or why the peer cannot run here (``unavailable``)."""

    answer: PeerAnswer | None = None
    unavailable: str | None = None
    key: str | None = None  # compare.build_key of the inputs it was built from
    reused: bool = False  # this comparison took it from an earlier one


@register_job
class PeerBuildJob(JobBase):
    kind: Literal["peer-build"] = "peer-build"
    result_type: ClassVar[type[Contract]] = PeerBuilt
    timeout_s: ClassVar[float] = 3600.0
    inputs: PeerInputs

    def run(self, started: float) -> PeerBuilt:
        from servopt.peers.base import PEERS

        peer = PEERS.get(self.inputs.peer)
        self.inputs.out_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            answer = peer.build(self.inputs)
        except PeerUnavailable as e:
            return PeerBuilt(unavailable=str(e))
        return PeerBuilt(answer=answer.model_copy(update={"build_s": answer.build_s or time.perf_counter() - t0}))
