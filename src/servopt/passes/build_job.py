"""Building a variant's pass chain as a job in its own process.

A quantizer that crashes, leaks memory or prints its own progress bars cannot
take the sweep (or its display) down with it; the build's output lands in its
job log, and a distributed sweep can run builds as tasks like any other job.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from servopt.bench.jobs import JobBase, register_job
from servopt.contracts import Artifact, ChainStep, Contract, ModelRef


@register_job
class BuildJob(JobBase):
    kind: Literal["build"] = "build"
    result_type: ClassVar[type[Contract]] = Artifact
    timeout_s: ClassVar[float] = 3600.0
    start: Artifact
    chain: list[ChainStep]
    cache: str  # the artifacts folder (content-addressed, shared by every variant of the run)
    source: ModelRef
    calibration: str | None = None  # .npz datasets
    tuning: str | None = None

    def run(self, started: float) -> Artifact:
        from servopt.data.dataset import Dataset
        from servopt.errors import UserError
        from servopt.models.sources import LoadedModel
        from servopt.passes.base import BuildContext, build_chain, build_data_key

        if self.start.data_key is not None and self.start.data_key != build_data_key(self.calibration, self.tuning):
            raise UserError("the build's calibration/tuning data are not the data its cache key names",
                            fix="key the start artifact with build_data_key() of the same files the build reads")
        ctx = BuildContext(source=LoadedModel.from_ref(self.source),
                           calibration=Dataset.load(Path(self.calibration)) if self.calibration else None,
                           tuning=Dataset.load(Path(self.tuning)) if self.tuning else None, log=lambda m: print(m, flush=True))
        return build_chain(self.start, [(s.pass_name, s.params) for s in self.chain], Path(self.cache), ctx)
