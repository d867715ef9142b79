"""Servers on free loopback ports for tests and benchmarks: one way to pick a port, and one way to run ``servopt serve``
in a process of its own, wait until it answers, read its memory and CPU, and stop it gracefully.

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


class ServerProcess:
    """``servopt serve SOURCE ARGS`` in its own process on free loopback ports (REST, and gRPC with ``grpc=True``),
    ready once ``/v2/health/ready`` answers 200: the gRPC front end starts in the same lifespan, before REST listens.

    It runs this very servopt (its source folder first on ``PYTHONPATH``), or the one under ``src`` (another version's
    source folder, for a same-run comparison); its output goes to a temporary file, shown when it fails to start.
    ``with ServerProcess(...) as s:`` stops it with SIGTERM (graceful) on the way out."""

    def __init__(self, source: str | Path, *args: str, grpc: bool = False, env: dict[str, str] | None = None,
                 start_timeout_s: float = 120.0, src: str | Path | None = None) -> None:
        self.port = free_port()
        self.grpc_port = free_port() if grpc else None
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}" if grpc else None
        cmd = [sys.executable, "-m", "servopt", "serve", str(source), "--host", "127.0.0.1", "--port", str(self.port), *args]
        if grpc:
            cmd += ["--grpc-port", str(self.grpc_port)]
        src = str(src or Path(servopt.__file__).resolve().parents[1])
        environ = {**os.environ, **(env or {})}
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, environ.get("PYTHONPATH", "")) if p)
        self.log = tempfile.NamedTemporaryFile(prefix="servopt-serve-", suffix=".log", delete=False)  # noqa: SIM115 - closed in stop
        self.command = cmd
        self.proc = subprocess.Popen(cmd, env=environ, stdout=self.log, stderr=subprocess.STDOUT)
        from servopt.bench.launcher import track

        track(self.proc)  # a sweep stopped by SIGINT/SIGTERM (launcher.stop_all) stops it too
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        output = self.output()
        self.stop()
        raise RuntimeError(f"`{' '.join(self.command)}` did not become ready in {timeout_s:g} s:\n{output[-3000:]}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def rss_bytes(self) -> int:
        """Resident memory of the server process now (Linux: /proc; elsewhere psutil when installed)."""
        status = Path(f"/proc/{self.proc.pid}/status")
        if status.exists():
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

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

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        Path(self.log.name).unlink(missing_ok=True)
