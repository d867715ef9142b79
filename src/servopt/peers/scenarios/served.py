"""Served scenarios: each answer behind a server as a user runs it, loaded by the same client from this process.

servopt's pick runs under ``servopt serve RUN --target T`` (``serve.harness.ServerProcess``); a peer that has a server
of its own (``Peer.serves``: Infinity …) runs under it (``Peer.serve``). Peers without a server have no served figure.
Each round starts one server, loads it, stops it, then the next (the runner flips the order), so no two servers share
the cores. The load is servopt's load generator (``serve.load``: its cheapest sender, keep-alive connections, the body
encoded once, latency from each request's scheduled time), one sample a request, in the API the peers' servers speak
(``oip-v2``, or OpenAI's ``/v1/embeddings`` for text embedding servers, which ``servopt serve`` answers too):

- ``served``: a closed loop at ``CONCURRENCY`` clients: requests/s (``served-p50``, ``served-p99``: its latencies);
- ``poisson``: an open loop with Poisson arrivals at ``RATE`` requests/s, below either server's capacity on a small
  machine: its p99 (what a user sees at a load the server keeps up with).

Each step also reads the server process tree's CPU seconds (``bench.cputime``), kept as CPU per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from servopt.contracts import Contract, Interference
from servopt.peers.base import ServedApi, Server
from servopt.peers.scenario import Scenario, register_scenario

CONCURRENCY = 8  # closed-loop clients
RATE = 40.0  # Poisson arrivals a second
MODEL = "model"  # the name servopt serve gives the pick


@dataclass
class ServedJob:
    """One answer's server for one round: how to start it (ready when it returns)."""

    name: str
    start: Callable[[], Server]
    texts: list[str] | None = None  # embedded once the load steps are done: the served answer's quality


class ServedMeasured(Contract):
    """One round of one server: each load step's summary (``serve.load.StepSummary``), its start time and CPU per request."""

    status: Literal["ok", "failed"] = "ok"
    error: str | None = None
    steps: dict[str, dict[str, Any]] = Field(default_factory=dict)  # "closed", "poisson" → the step's summary
    start_s: float | None = None
    command: list[str] = Field(default_factory=list)
    embeddings: list[list[float]] | None = None  # the job's texts, embedded by the server (OpenAI API)
    embed_error: str | None = None  # why the texts could not be embedded
    interference: Interference | None = None  # not read for servers: the client shares the machine by design


class Served(Scenario):
    """A figure of one load step of a served round: ``path`` into the step's summary (``serve.load.StepSummary``)."""

    served: ClassVar[bool] = True
    step: ClassVar[str]
    path: ClassVar[tuple[str, ...]]

    def figure(self, m: Any) -> float | None:
        v: Any = getattr(m, "steps", {}).get(self.step)
        if not v or not v.get("ok"):
            return None
        for key in self.path:
            v = v.get(key) if isinstance(v, dict) else None
        return float(v) if isinstance(v, int | float) and v == v else None  # NaN: none


CLOSED = f"served, closed loop at {CONCURRENCY} clients"
# (name, metric, better, step, path in the step's summary, what it is, its column heading)
FIGURES = (("served", "served_rps", "higher", "closed", ("throughput_rps",), f"{CLOSED}: requests/s",
            "served requests/s (closed loop)"),
           ("served-p50", "served_p50_ms", "lower", "closed", ("latency_ms", "p50"), f"{CLOSED}: p50 latency", "served p50"),
           ("served-p99", "served_p99_ms", "lower", "closed", ("latency_ms", "p99"), f"{CLOSED}: p99 latency", "served p99"),
           ("served-cpu", "served_cpu_ms", "lower", "closed", ("server_cpu_ms_per_request",),
            f"{CLOSED}: the server process tree's CPU per request", "server CPU per request"),
           ("poisson", "poisson_p99_ms", "lower", "poisson", ("latency_ms", "p99"),
            f"served, Poisson arrivals at {RATE:g} requests/s: p99 latency", "p99 at a Poisson rate"))
for _name, _metric, _better, _step, _path, _what, _label in FIGURES:
    register_scenario(type(f"Served_{_metric}", (Served,), {"name": _name, "metric": _metric, "better": _better, "step": _step,
                                                           "path": _path, "description": _what, "label": _label}))
SERVED = [f[0] for f in FIGURES]


def sentence() -> str:
    """The request's text: a typical short query of servopt's shipped texts (the median length of the first 50)."""
    from servopt.data.text import DEMO_SENTENCES

    lines = [line.strip() for line in DEMO_SENTENCES.read_text().splitlines() if line.strip()][:50]
    return sorted(lines, key=len)[len(lines) // 2]


def _requests(server: Server) -> list:
    """The request every server is loaded with, in the API it speaks: one typical sentence, or for a model of tensors
    one sample made from its metadata."""
    from servopt.serve.load.requests import json_request
    from servopt.serve.ratesearch import server_requests

    if server.api == "openai-embeddings":
        return [json_request("/v1/embeddings", {"model": server.model, "input": [sentence()]})]
    return server_requests(server.url, server.model, None, sentence=sentence())[0]


def measure(job: ServedJob, workdir: Path, *, seconds: float = 10.0, warmup: float = 2.0) -> ServedMeasured:
    """Start the server, run the closed loop then the Poisson loop (``serve.load``, its cheapest sender), stop it; a
    server that does not start, or answers nothing, is a failed measurement with the reason."""
    from servopt.bench.cputime import tree_cpu_s

    embed_error = None
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        server = job.start()
    except Exception as e:  # noqa: BLE001 - any start failure is this answer's failed round, with the reason
        return ServedMeasured(status="failed", error=f"its server did not start: {type(e).__name__}: {str(e)[-1500:]}")
    try:
        async def load() -> dict[str, dict[str, Any]]:
            from servopt.serve.load import Closed, Open, Pool, open_sender, run

            pool = Pool(_requests(server))
            probe = (lambda: (tree_cpu_s(server.pid),)) if server.pid else None
            steps: dict[str, dict[str, Any]] = {}
            async with open_sender("raw", server.url) as sender:
                for step, schedule, warm in (("closed", Closed(CONCURRENCY), warmup), ("poisson", Open(RATE), warmup / 2)):
                    summary, _ = await run(sender, pool, schedule, seconds, warmup=warm, probe=probe)
                    figures = summary.model_dump(mode="json")
                    if summary.probe and summary.ok:
                        figures["server_cpu_ms_per_request"] = summary.probe[0] * 1000 / summary.ok
                    steps[step] = figures
            return steps

        steps = asyncio.run(load())
        try:
            embeddings = embed(server, job.texts) if job.texts else None
        except Exception as e:  # noqa: BLE001 - its figures stand; its quality is then not judged, and said why
            embeddings, embed_error = None, f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        server.stop()
    bad = {k: s["errors"] for k, s in steps.items() if not s["ok"]}
    if bad:
        return ServedMeasured(status="failed", error=f"its server answered no request ({bad})", steps=steps,
                              start_s=server.start_s, command=server.command)
    return ServedMeasured(steps=steps, start_s=server.start_s, command=server.command, embeddings=embeddings,
                          embed_error=embed_error)


def embed(server: Server, texts: list[str], batch: int = 32) -> list[list[float]] | None:
    """``texts`` embedded by the server, in order (OpenAI's ``/v1/embeddings``; None for a server without it)."""
    import httpx

    if server.api != "openai-embeddings":
        return None
    out: list[list[float]] = []
    with httpx.Client(timeout=60) as client:
        for i in range(0, len(texts), batch):
            r = client.post(f"{server.url}/v1/embeddings", json={"model": server.model, "input": texts[i:i + batch]})
            r.raise_for_status()
            out += [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    return out


def eval_texts(folder: str | Path, data: Path) -> list[str] | None:
    """The run's evaluation samples as texts: its token ids decoded by the model folder's ``tokenizer.json`` (or that
    file itself; ``data.text.decode_texts``), so a tool that tokenizes for itself embeds the same sentences; None
    without one."""
    from servopt.data.dataset import Dataset
    from servopt.data.text import decode_texts

    path = Path(folder) if Path(folder).suffix == ".json" else Path(folder) / "tokenizer.json"
    if not path.exists():
        return None
    return decode_texts(path, Dataset.load(data).inputs)


def pick_server(run_dir: Path, target: str, nearest: bool, api: ServedApi) -> Server:
    """servopt's pick for ``target`` under ``servopt serve RUN --target T`` (its defaults for the target), ready."""
    from servopt.serve.harness import ServerProcess

    t0 = time.perf_counter()
    proc = ServerProcess(run_dir, "--target", target, *(["--nearest"] if nearest else []), "--name", MODEL)
    return Server(url=proc.url, model=MODEL, stop=proc.stop, api=api, pid=proc.proc.pid, command=proc.command,
                  start_s=time.perf_counter() - t0)
