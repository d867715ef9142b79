"""One launcher for every measurement job: a fresh process, one failure shape, a script that replays it alone.

Each job gets a folder with ``job.json``, ``job.log`` (its stdout and stderr)
and ``replay.sh``: the exact command, interpreter and environment, so a crash
in one variant can be re-run and debugged by itself (Model Navigator's
reproduce scripts). A job that crashes, times out or fails with a user error
comes back as a ``JobFailure`` with the reason, never as an exception: the
sweep records it and goes on. Jobs timed from outside (cold start) print a
marker when they have their answer; the launcher's clock stops on it.

Every job runs in a process group of its own, tracked while it runs: ``stop_all`` (the command's SIGINT/SIGTERM
handler) kills each group, so a build's or a measurement's own children go too, and no job is started after it
(``Interrupted``); a job also dies with the process that launched it (``SERVOPT_DIE_WITH_PARENT``), so a kill -9 of
the sweep leaves no orphan. A job given a ``deadline`` (a time budget's end) that reaches it is stopped and raises
``OutOfTime``: not finished, never a failure a resumed run would trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from pydantic import ValidationError

from servopt.bench.jobs import READY, JobBase
from servopt.contracts import Contract
from servopt.errors import UserError

R = TypeVar("R", bound=Contract)
SRC = str(Path(__file__).resolve().parents[2])  # servopt's source folder, importable by any interpreter


class Interrupted(BaseException):  # like KeyboardInterrupt: no ``except Exception`` records it as a failure
    """The run was asked to stop (SIGINT/SIGTERM): the job under way was killed, and no job starts after it."""


class OutOfTime(Exception):
    """A job stopped at its deadline (the time budget's end): not finished, to be tried again with more time."""


_running: set[subprocess.Popen] = set()  # the job processes running now (each the leader of its process group)
_lock = threading.RLock()  # re-entered by stop_all in a signal handler interrupting launch
_stopping = threading.Event()


def stopping() -> bool:
    return _stopping.is_set()


def stop_all() -> int:
    """Stop every job process running now with its whole process group (and every ``track``-ed process), and refuse new
    ones (``Interrupted``). Safe in a signal handler. Returns how many processes it stopped."""
    _stopping.set()
    with _lock:
        procs = list(_running)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(proc.pid) == proc.pid:  # a job: the leader of its own group
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
    return len(procs)


def track(proc: subprocess.Popen) -> None:
    """A process the sweep starts outside ``launch`` (a server its capacity search serves a pick with): ``stop_all``
    stops it too. ``untrack`` it once it has ended."""
    with _lock:
        _running.add(proc)


def untrack(proc: subprocess.Popen) -> None:
    with _lock:
        _running.discard(proc)


def reset_stop() -> None:
    """Allow jobs again (a test, or a command run twice in one process)."""
    _stopping.clear()


class JobFailure(Contract):
    error: str
    exit_code: int | None = None
    log: str
    replay: str


@dataclass
class Launched(Generic[R]):
    """A finished job: its typed result, or why there is none."""

    result: R | None
    failure: JobFailure | None
    wall_s: float
    ready_s: float | None = None  # spawn → the job's READY marker (cold start)

    @property
    def error(self) -> str | None:
        return self.failure.error if self.failure else None


def job_env(job: JobBase) -> dict[str, str]:
    """This environment, servopt's source importable first, plus the job's own variables."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(job.env)
    return env


def interpreter(job: JobBase, progress=lambda _m: None) -> tuple[str, dict[str, str]]:
    """The interpreter and environment variables to run ``job`` with: this Python, or the environment its runtimes
    declare (created on first use; ``servopt.envs``). Raises ``UserError`` when that environment cannot be made."""
    from servopt.envs import job_env as env_for
    from servopt.runtimes import get_runtime

    envs = [get_runtime(r).environment() for r in dict.fromkeys(job.runtimes())]
    specs = {s.key(): s for s in envs if s is not None}
    if not specs:
        return job.python or sys.executable, job_env(job)
    if len(specs) > 1 or any(s is None for s in envs):
        raise UserError(f"the runtimes {sorted(set(job.runtimes()))} need different Python environments: one job cannot run them",
                        fix="measure them in separate jobs")
    from servopt.envs import ensure_env

    spec = next(iter(specs.values()))
    ready = ensure_env(spec, progress)
    env = env_for(ready, base={**os.environ, **job.env})
    env["SERVOPT_RUNTIME_ENV"] = f"{ready.name}-{ready.key}"  # recorded in the measurement's environment
    return str(ready.python), env


def write_replay(job: JobBase, workdir: Path, python: str, env_vars: dict[str, str]) -> Path:
    keep = {k: v for k, v in env_vars.items() if k in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONNOUSERSITE", "SERVOPT_RUNTIME_ENV")
            or k in job.env}
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in keep.items())
    script = workdir / "replay.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"# Replays this {job.kind} job alone (same interpreter, environment and inputs); the result goes to replay-out.json.\n"
        f"exec env {env} {shlex.quote(python)} -m servopt.runjob {shlex.quote(str(workdir / 'job.json'))} "
        f"{shlex.quote(str(workdir / 'replay-out.json'))}\n")
    script.chmod(0o755)
    return script


def launch(job: JobBase, workdir: Path, timeout_s: float | None = None, deadline: float | None = None) -> Launched:
    """Run ``job`` in a fresh process and return its typed result (``type(job).result_type``) or its failure.
    ``deadline`` (``time.time()``): a job still running then is stopped and raises ``OutOfTime``, as does one
    launched after it; ``stop_all`` makes it raise ``Interrupted``."""
    if _stopping.is_set():
        raise Interrupted(f"{job.kind} not started: the run is stopping")
    timeout = timeout_s or type(job).timeout_s
    budgeted = deadline is not None and deadline - time.time() < timeout  # the deadline, not the job's own limit, binds
    if budgeted:
        timeout = deadline - time.time()  # type: ignore[operator]
        if timeout <= 0:
            raise OutOfTime(f"{job.kind} not started: the time budget had run out")
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = workdir / "job.json", workdir / "out.json", workdir / "job.log"
    out_path.unlink(missing_ok=True)
    job_path.write_text(job.model_dump_json(indent=1))
    try:
        python, env_vars = interpreter(job)
    except UserError as e:
        return Launched(None, JobFailure(error=e.problem, log=str(log_path), replay=""), 0.0)
    replay = write_replay(job, workdir, python, env_vars)
    env_vars.setdefault("SERVOPT_DIE_WITH_PARENT", str(os.getpid()))  # a Ray worker sets its own pid (ray_executor)
    cmd = [python, "-m", "servopt.runjob", str(job_path), str(out_path)]
    start = time.perf_counter()
    ready: dict[str, float] = {}
    with open(log_path, "w") as log:
        with _lock:  # registered before stop_all can miss it, and never started after stop_all
            if _stopping.is_set():
                raise Interrupted(f"{job.kind} not started: the run is stopping")
            # its own process group: a terminal's Ctrl-C reaches only the sweep, which stops the group (stop_all)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env_vars, process_group=0)
            _running.add(proc)
        if _stopping.is_set():  # stop_all ran in this thread's signal handler while the process was starting
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

        def watch() -> None:  # stdout to the log, noting when the READY marker arrives
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.strip() == READY and "at" not in ready:
                    ready["at"] = time.perf_counter() - start
                else:
                    log.write(line)

        reader = threading.Thread(target=watch, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
        finally:
            with _lock:
                _running.discard(proc)
        reader.join(timeout=5)
    wall = time.perf_counter() - start
    if _stopping.is_set():
        _kill_group(proc)  # stop_all may have killed only the leader's group as it was starting its own children
        raise Interrupted(f"{job.kind} stopped after {wall:.0f} s: the run is stopping")
    if code is None and budgeted:
        raise OutOfTime(f"stopped at the time budget's end after {wall:.0f} s")

    def failed(error: str) -> Launched:
        return Launched(None, JobFailure(error=error, exit_code=code, log=str(log_path), replay=str(replay)), wall, ready.get("at"))

    if code is None:
        return failed(f"timed out after {timeout:.0f} s (replay: {replay})")
    if code != 0 or not out_path.exists():
        tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])
        return failed(f"the {job.kind} process exited {code}: {tail} (replay: {replay})")
    data = json.loads(out_path.read_text())
    if "job_error" in data:
        return failed(data["job_error"])
    try:
        return Launched(type(job).result_type.model_validate(data), None, wall, ready.get("at"))
    except ValidationError as e:  # the job process ran another servopt (an environment with a stale copy?)
        return failed(f"the {job.kind} result does not match this servopt's contracts: {str(e).splitlines()[0]}")


def _kill_group(proc: subprocess.Popen) -> None:
    """The job's process and whatever it started (its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
