"""A distributed sweep: every job of ``servopt optimize`` as a Ray task, one at a time per node (``--ray ADDRESS``).

Each node that may run servopt's jobs declares one unit of the custom resource ``servopt_slot``
(``ray start --resources '{"servopt_slot": 1, "epyc-7763": 1}'``) and every task asks for one: a node runs one job at
a time (a build, a measurement with its cold start, an interleaved re-measure or a profile), so no measurement ever
shares its machine with another servopt job, while different nodes work in parallel. A job for a kind of node also
asks for that kind's resources (a target's ``ray_resources``), so it lands on a node of that kind.

Inside the task the job runs exactly as on one machine (``bench.launcher.launch``: a fresh process, its folder in the
run directory, which every node must see at the same path). The task sets ``SERVOPT_NODE`` (host name and Ray node
id: simulated nodes share a host name), which ``machine.environment()`` and every timed ``Phase`` record, and
``SERVOPT_DIE_WITH_PARENT``, so the job's process dies with a killed worker instead of measuring on beside the retry.
A task whose worker or node died is retried by Ray (``RETRIES`` times, elsewhere when a node of its kind is left);
after that, or when no node of its kind is left, the job is ``Lost`` and its variant recorded as failed. A job that
fails on its own (a ``JobFailure``: a crash, a timeout, a failed verification) is not retried.

Ray is imported only inside this module's functions, and this module only when ``--ray`` is given.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar

from servopt.bench.launcher import Interrupted
from servopt.errors import UserError
from servopt.optimize.executor import LOST, Executor, Lost

SLOT = "servopt_slot"  # one per node: a node runs one servopt job at a time
RETRIES = 2  # a task whose worker or node died runs again at most this often
LOST_AFTER_S = 60.0  # a job no alive node can run (its kind's nodes died) is given up after this long
EXTRA = "pip install 'servopt[ray]'"


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise UserError("--ray needs Ray, which is not installed here", fix=f"install the extra: {EXTRA}") from e
    return ray


def node_label() -> str:
    """How a record names the node of a Ray task: host name and the start of the Ray node id."""
    import ray

    return f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"


def _node_environment() -> dict[str, str] | None:
    """The environment this node's Ray was started with (its raylet's), where it can be read (Linux)."""
    try:
        raw = Path(f"/proc/{os.environ['RAY_RAYLET_PID']}/environ").read_bytes()
    except (KeyError, OSError):
        return None
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def undo_worker_settings() -> None:
    """Ray starts its workers with ``OMP_NUM_THREADS=1`` when the node's environment does not set it (so that many
    small tasks do not oversubscribe the cores). A job process inherits it: PyTorch would run on one thread, and the
    measurement would not be the machine's (measured: MobileNetV2 eager batch throughput 15 img/s instead of 24-26).
    The job gets the node's own setting back, or none."""
    node = _node_environment()
    own = node.get("OMP_NUM_THREADS") if node is not None else (None if os.environ.get("OMP_NUM_THREADS") == "1" else
                                                                 os.environ.get("OMP_NUM_THREADS"))
    if own is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = own


def run_on_node(fn: Callable[..., Any], args: tuple) -> tuple[Any, dict[str, Any]]:
    """The body of every task: ``fn(*args)`` on this node, stamped with where and when it ran."""
    node = node_label()
    undo_worker_settings()
    os.environ["SERVOPT_NODE"] = node  # inherited by the job processes: their environment and phases say where
    os.environ["SERVOPT_DIE_WITH_PARENT"] = str(os.getpid())
    start = time.time()
    result = fn(*args)
    return result, {"node": node, "start": start, "stop": time.time(), "pid": os.getpid()}


def _read_marker(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def task_options(resources: dict[str, float] | None) -> dict[str, Any]:
    """Ray's options for a job on a node with ``resources``: the slot, plus the kind's resources (CPU, GPU and memory
    have options of their own in Ray)."""
    opts: dict[str, Any] = {"num_cpus": 0, "resources": {SLOT: 1}}
    for name, amount in (resources or {}).items():
        if name in ("CPU", "GPU", "memory"):
            opts[{"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}[name]] = amount
        else:
            opts["resources"][name] = amount
    return opts


def _fits(node_resources: dict[str, float], resources: dict[str, float] | None) -> bool:
    want = {SLOT: 1.0, **(resources or {})}
    return all(node_resources.get(k, 0.0) >= v for k, v in want.items())


class RayExecutor(Executor):
    distributed: ClassVar[bool] = True

    def __init__(self, owned: bool, retries: int = RETRIES, lost_after_s: float = LOST_AFTER_S) -> None:
        ray = import_ray()
        self.owned = owned  # this process connected (or started Ray): it disconnects at the end
        self.retries = retries
        self.lost_after_s = lost_after_s
        self._task = ray.remote(max_retries=retries, retry_exceptions=False)(run_on_node)
        self._pending: dict[Any, tuple[Future, dict[str, float] | None, str, float]] = {}
        self._unplaceable_since: dict[Any, float] = {}
        self._cancelled: dict[Any, str] = {}
        self._lock = threading.Lock()
        self._log: Path | None = None
        self._stop = threading.Event()
        self._interrupted = False
        self._watch = threading.Thread(target=self._watchdog, name="servopt-ray-watchdog", daemon=True)
        self._watch.start()

    @classmethod
    def connect(cls, address: str) -> RayExecutor:
        """``local``: start Ray here with one slot; ``auto``, ``host:port`` or ``ray://host:10001``: join a cluster.
        A Ray already initialized in this process is used as it is."""
        import logging

        ray = import_ray()
        if ray.is_initialized():
            return cls(owned=False)
        try:
            if address == "local":
                ray.init(resources={SLOT: 1}, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
            else:
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise UserError(f"cannot connect to the Ray cluster at {address!r}: {str(e).splitlines()[0]}",
                            fix="start one (ray start --head --resources '{\"servopt_slot\": 1}') or pass --ray local") from e
        return cls(owned=True)

    # -- checks before the sweep -------------------------------------------------------------------------------------
    @staticmethod
    def _alive_nodes() -> list[dict]:
        import ray

        return [n for n in ray.nodes() if n.get("Alive")]

    def prepare(self, run_dir: Path, kinds: dict[str, dict[str, float]]) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [n for n in self._alive_nodes() if n["Resources"].get(SLOT, 0) >= 1]
        if not nodes:
            raise UserError(f"no node of the Ray cluster declares the {SLOT} resource, so none may run servopt's jobs",
                            fix=f"start each node with ray start … --resources '{{\"{SLOT}\": 1}}' (see docs/ray.md)")
        for kind, resources in kinds.items():
            if not any(_fits(n["Resources"], resources) for n in nodes):
                wanted = {SLOT: 1, **{k: int(v) if float(v).is_integer() else v for k, v in resources.items()}}
                raise UserError(f"no node of the Ray cluster declares {', '.join(f'{k}={v:g}' for k, v in wanted.items())}, "
                                f"which the targets of kind {kind} need",
                                fix=f"start such a node (ray start … --resources '{json.dumps(wanted)}'), or fix the targets' "
                                    "ray_resources")
        # Every job reads and writes the run directory: it must be the same folder on every node.
        marker = run_dir / "work" / f".shared-{uuid.uuid4().hex}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(marker.name)
        try:
            check = ray.remote(num_cpus=0)(_read_marker)
            refs = {n["NodeID"]: check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                    .remote(str(marker)) for n in nodes}
            blind = [node for node, seen in zip(refs, ray.get(list(refs.values()), timeout=300), strict=True) if seen != marker.name]
        finally:
            marker.unlink(missing_ok=True)
        if blind:
            raise UserError(f"the run directory {run_dir} is not visible from Ray node(s) {', '.join(b[:8] for b in blind)}",
                            fix="put --out on a filesystem every node mounts at the same path (NFS, a cluster file system)")
        self._log = run_dir / "work" / "ray-tasks.jsonl"

    # -- running jobs ------------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any, resources: dict[str, float] | None = None, what: str = "",
               exclusive: bool = True) -> Future:
        """Every task holds its node's slot, builds too (``exclusive`` is for one machine, where builds share it)."""
        if self._interrupted:
            raise Interrupted(f"{what or 'a task'} not submitted: the run is stopping")
        result: Future = Future()
        ref = self._task.options(**task_options(resources), name=f"servopt {what}"[:100]).remote(fn, args)
        with self._lock:
            self._pending[ref] = (result, resources, what, time.time())
        ref.future().add_done_callback(lambda inner, ref=ref: self._done(ref, inner))
        return result

    def _done(self, ref: Any, inner: Future) -> None:
        import ray.exceptions as rex

        with self._lock:
            result, resources, what, _ = self._pending.pop(ref)
            self._unplaceable_since.pop(ref, None)
            cancelled = self._cancelled.pop(ref, None)
        try:
            value, where = inner.result()
        except rex.RayTaskError as e:  # the function raised: that error, as if it had been called here
            result.set_exception(e.as_instanceof_cause())
            return
        except Exception as e:  # noqa: BLE001  (a RayError: the worker or node died after the retries, or it was given up)
            if cancelled == INTERRUPTED:  # stop(): not lost, so no failed record (a resumed run measures it)
                result.set_exception(Interrupted(f"{what}: {INTERRUPTED}"))
                return
            why = cancelled or f"{type(e).__name__} after {self.retries + 1} attempts: {_first_line(e)}"
            self._append({"what": what, "resources": resources, "lost": why})
            result.set_exception(Lost(f"{LOST}: {why}"))
            return
        self._append({"what": what, "resources": resources, **where})
        result.set_result(value)

    def _append(self, entry: dict[str, Any]) -> None:
        """``work/ray-tasks.jsonl``: where and when every job ran (written here, by the driver, never by the nodes)."""
        if self._log is None:
            return
        with self._lock, open(self._log, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _watchdog(self) -> None:
        """Give up a job that no alive node can run any more (every node of its kind died) after ``lost_after_s``:
        Ray would keep it waiting for such a node forever."""
        import ray

        while not self._stop.wait(2.0):
            with self._lock:
                waiting = {ref: entry[1] for ref, entry in self._pending.items() if ref not in self._cancelled}
            if not waiting:
                continue
            try:
                nodes = [n["Resources"] for n in self._alive_nodes()]
            except Exception:  # noqa: BLE001  (the cluster is shutting down: nothing to watch)
                continue
            now = time.time()
            for ref, resources in waiting.items():
                if any(_fits(n, resources) for n in nodes):
                    self._unplaceable_since.pop(ref, None)
                    continue
                since = self._unplaceable_since.setdefault(ref, now)
                if now - since >= self.lost_after_s:
                    with self._lock:
                        self._cancelled[ref] = (f"no alive node of the cluster has {SLOT} and {resources or 'no other resources'} "
                                                f"(for {now - since:.0f} s): its nodes died")
                    ray.cancel(ref, force=True)

    def stop(self) -> None:
        """SIGINT/SIGTERM: nothing more is submitted, and every task under way is cancelled (its worker killed, the job's
        process with it); their futures raise ``launcher.Interrupted``."""
        import ray

        self._interrupted = True
        with self._lock:
            refs = list(self._pending)
            self._cancelled.update(dict.fromkeys(refs, INTERRUPTED))
        for ref in refs:
            ray.cancel(ref, force=True)

    def close(self) -> None:
        self._stop.set()
        self._watch.join(timeout=5)
        if self.owned:
            import ray

            ray.shutdown()


INTERRUPTED = "the run was interrupted (SIGINT/SIGTERM)"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
