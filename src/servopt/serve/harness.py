"""Servers on free loopback ports for tests and benchmarks: one way to pick a port, and one way to run a server in a
process of its own (``AppProcess``: any command, a peer's server in its own environment too; ``ServerProcess``:
``servopt serve``, this revision or another's source), wait until it answers, read its memory and CPU, and stop it
gracefully.

Benchmarks measure the server as a user runs it (the CLI, its own process, so the load generator's CPU is not the
server's); the tests' in-process harness (``tests/conftest.py``) uses ``free_port`` from here too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

import servopt


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def revision_src(rev: str, cache: Path, repo: Path | None = None) -> Path:
    """The ``src`` folder of git revision ``rev`` of servopt's repository (``git archive``, kept under ``cache``): what
    ``ServerProcess(src=...)`` runs to compare two versions of the server in one run."""
    repo = repo or Path(servopt.__file__).resolve().parents[2]
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    out = cache / f"src-{sha}"
    if not (out / "src" / "servopt").is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache))
        archive = subprocess.run(["git", "-C", str(repo), "archive", sha, "src"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out / "src"


# Linux: the command runs under this shim, which asks the kernel to send it SIGTERM when the process that started it
# dies (prctl PR_SET_PDEATHSIG, kept across exec), then becomes the command (exec: same pid). A sweep killed with
# kill -9 left the `servopt serve` of its capacity search running, beside whatever measured next. The signal comes when
# the *thread* that started it ends: servers are started from the thread that uses them (the sweep's main thread).
_PDEATHSIG_SHIM = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
                   "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execvp(sys.argv[2], sys.argv[2:])")


def dies_with_this_process(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it ends with this process, even on kill -9 (Linux; elsewhere ``cmd`` as it is)."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()), *cmd]


class AppProcess:
    """Any HTTP server in its own process (``cmd``, from any Python environment), ready once it answers: a GET of
    ``ready_path`` with 200, or a POST of ``ready_body`` there (a peer's server that has no health route is ready when
    it embeds). Its output goes to a temporary file, shown when it fails to start; ``start_s`` is how long it took to
    answer. ``with AppProcess(...) as s:`` stops it with SIGTERM (graceful) on the way out; a sweep stopped by
    SIGINT/SIGTERM stops it too (``launcher.stop_all``), and starts none after; it dies with this process, even on
    kill -9 (``dies_with_this_process``)."""

    def __init__(self, cmd: list[str], port: int, *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 ready_path: str = "/v2/health/ready", ready_body: bytes | None = None, start_timeout_s: float = 120.0) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.command = cmd
        from servopt.bench.launcher import Interrupted, stopping, track

        if stopping():  # the sweep is stopping (SIGINT/SIGTERM): no server starts after stop_all has run
            raise Interrupted(f"`{' '.join(cmd[:4])} …` not started: the run is stopping")
        self.log = tempfile.NamedTemporaryFile(prefix="servopt-app-", suffix=".log", delete=False)  # noqa: SIM115 - closed in stop
        t0 = time.monotonic()
        self.proc = subprocess.Popen(dies_with_this_process(cmd), env=env, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT)
        track(self.proc)
        if stopping():  # stop_all ran while it was starting: it may have missed it
            self.stop(timeout_s=5)
            raise Interrupted(f"`{' '.join(cmd[:4])} …` stopped as it started: the run is stopping")
        self._wait_ready(ready_path, ready_body, start_timeout_s)
        self.start_s = time.monotonic() - t0

    def _wait_ready(self, path: str, body: bytes | None, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                r = (httpx.post(self.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=5)
                     if body is not None else httpx.get(self.url + path, timeout=1))
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        code = self.proc.poll()
        output = self.output()
        self.stop()
        why = f"exited with code {code} while starting" if code is not None else f"did not become ready in {timeout_s:g} s"
        raise RuntimeError(f"`{' '.join(self.command)}` {why}:\n{output[-3000:]}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def rss_bytes(self) -> int:
        """Resident memory of the server's process tree now (Linux: /proc; elsewhere psutil, the process alone)."""
        if Path(f"/proc/{self.proc.pid}/status").exists():
            from servopt.bench.cputime import tree_kb

            return tree_kb(self.proc.pid, "VmRSS") * 1024
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def peak_rss_bytes(self) -> int:
        """The peak resident memory of each process of the tree, summed (Linux only; 0 elsewhere)."""
        from servopt.bench.cputime import tree_kb

        return tree_kb(self.proc.pid, "VmHWM") * 1024 if Path(f"/proc/{self.proc.pid}/status").exists() else 0

    def cpu_seconds(self) -> float:
        """User + system CPU time the server and its child processes have used so far (``bench.cputime``)."""
        if Path(f"/proc/{self.proc.pid}/stat").exists():
            from servopt.bench.cputime import tree_cpu_s

            return tree_cpu_s(self.proc.pid)
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (uvicorn finishes what is in flight, the batcher drains), then SIGKILL if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        from servopt.bench.launcher import untrack

        untrack(self.proc)
        self.log.close()
        return self.proc.returncode

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        Path(self.log.name).unlink(missing_ok=True)


def servopt_env(src: str | Path | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with ``env`` over it and servopt's source folder (``src``: another version's) first on
    ``PYTHONPATH``: how a process runs this very servopt, or another revision of it."""
    src = str(src or Path(servopt.__file__).resolve().parents[1])
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, environ.get("PYTHONPATH", "")) if p)
    return environ


class ServerProcess(AppProcess):
    """``servopt serve SOURCE ARGS`` in its own process on free loopback ports (REST, and gRPC with ``grpc=True``),
    ready once ``/v2/health/ready`` answers 200: the gRPC front end starts in the same lifespan, before REST listens.

    It runs this very servopt (its source folder first on ``PYTHONPATH``), or the one under ``src`` (another version's
    source folder, for a same-run comparison: ``revision_src``)."""

    def __init__(self, source: str | Path, *args: str, grpc: bool = False, env: dict[str, str] | None = None,
                 start_timeout_s: float = 120.0, src: str | Path | None = None) -> None:
        port = free_port()
        self.grpc_port = free_port() if grpc else None
        self.grpc_url = f"127.0.0.1:{self.grpc_port}" if grpc else None
        cmd = [sys.executable, "-m", "servopt", "serve", str(source), "--host", "127.0.0.1", "--port", str(port), *args]
        if grpc:
            cmd += ["--grpc-port", str(self.grpc_port)]
        super().__init__(cmd, port, env=servopt_env(src, env), start_timeout_s=start_timeout_s)
