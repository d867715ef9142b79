"""Where the sweep's jobs run: here, one after another (``LocalExecutor``), or as tasks on a Ray cluster
(``ray_executor.RayExecutor``, ``servopt optimize --ray ADDRESS``).

The sweep hands every unit of work (a build, a variant's measurement, an interleaved re-measure, a profile) to an
executor as a plain function and its arguments, with the Ray resources of the kind of node it must run on, and gets a
``concurrent.futures.Future`` back: one algorithm for both. The local executor resolves an exclusive unit (anything
timed, or a build that times itself) at once, in this process, after whatever else is running has finished; the
others (builds) run two at a time in threads, each in its own process. Nothing of Ray is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, ClassVar

from servopt.bench.launcher import Interrupted


class Lost(Exception):
    """A job no node brought back: its worker or node died more often than the retries allow, or no node of its kind
    is left in the cluster. The runner records the variant as failed with this reason."""


LOST = "job lost"  # how a record's error starts when its job was lost (a rerun measures it again)


class Executor:
    distributed: ClassVar[bool] = False

    def prepare(self, run_dir: Path, kinds: dict[str, dict[str, float]]) -> None:
        """Check that the jobs can run: ``kinds`` maps each kind of node (``targets.measurement_kind``) to its
        resources. Raises ``UserError`` when they cannot."""

    def submit(self, fn: Callable[..., Any], *args: Any, resources: dict[str, float] | None = None, what: str = "",
               exclusive: bool = True) -> Future:
        """Run ``fn(*args)`` on a node with ``resources`` (None: any node); ``exclusive``: alone there (a measurement),
        else beside other non-exclusive units (a build, which times nothing). The future holds its result."""
        raise NotImplementedError

    def stop(self) -> None:
        """The run is stopping (SIGINT/SIGTERM, after ``launcher.stop_all``): start nothing more, give up what waits."""

    def close(self) -> None:
        pass

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalExecutor(Executor):
    """Everything on this machine: exclusive units one after another in the calling thread (nothing else running),
    the others ``parallel`` at a time in worker threads."""

    def __init__(self, parallel: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="servopt-build")
        self._running: set[Future] = set()
        self._stopped = False

    def submit(self, fn: Callable[..., Any], *args: Any, resources: dict[str, float] | None = None, what: str = "",
               exclusive: bool = True) -> Future:
        if self._stopped:
            raise Interrupted(f"{what or 'a job'} not started: the run is stopping")
        if not exclusive:
            future = self._pool.submit(fn, *args)
            self._running.add(future)
            future.add_done_callback(self._running.discard)
            return future
        wait(list(self._running))  # a measurement (or a self-timing build) never shares the machine with a build
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001  (raised again by .result(), in the caller, as if called directly)
            done.set_exception(e)
        return done

    def stop(self) -> None:
        """Builds queued behind the two running are cancelled (their futures say so), none is started after; the
        running ones end with their processes (``launcher.stop_all``)."""
        self._stopped = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

