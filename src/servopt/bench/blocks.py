"""Timed blocks across Python environments: one long-lived worker per side, taking turns over a pipe.

Two tools that cannot share a process (servopt and a peer in its own environment) are compared block by block: each
side's worker loads and warms its backends once, then answers "time backend X on workload W for at least S seconds"
(``time_block``) as one JSON line while the other side waits on its pipe. A fresh process per round would pay loading,
export caches and warm-up between the two sides of a ratio, minutes apart on a machine whose load changes by the
minute. Standard library and NumPy only (plus ``bench.cputime``), so a worker in a peer's environment imports it with
servopt's source folder on ``PYTHONPATH``; ``BlockWorker`` is the controller's handle on one worker.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np

from servopt.bench.cputime import machine_busy_s, own_cpu_s, tree_cpu_s

Encode = Callable[[list[str], int], np.ndarray]
WORKLOADS = ("b32x128", "b1short", "texts")  # see workload()


def workload(inputs: dict, name: str) -> tuple[list[str], int]:
    """(texts, batch_size) of one workload; every side encodes exactly these texts with this batch size.

    b32x128: 32 texts of exactly 128 tokens, batch 32. b1short: one short sentence, batch 1. texts: the shipped
    sentences with their real lengths, batch 32 (each side batches them its own way). pool:NAME:B: the texts of
    ``inputs["pools"][NAME]``, batch B."""
    if name.startswith("pool:"):
        _, pool, batch = name.split(":")
        return list(inputs["pools"][pool]), int(batch)
    if name == "b32x128":
        return list(inputs["b32x128"]), 32
    if name == "b1short":
        return [inputs["short"]], 1
    if name == "texts":
        return list(inputs["texts"]), 32
    raise ValueError(f"unknown workload {name!r}")


def time_block(encode: Encode, texts: list[str], batch_size: int, *, min_calls: int, min_seconds: float,
               max_seconds: float, warmup: int = 1) -> dict:
    """One timed block: ``encode(texts, batch_size)`` until BOTH ``min_calls`` calls and ``min_seconds`` (or
    ``max_seconds``); each call's time, this process's CPU and the machine's busy CPU over the block."""
    for _ in range(warmup):
        encode(texts, batch_size)
    times: list[int] = []
    busy0, own0 = machine_busy_s()[0], own_cpu_s()
    start = time.perf_counter_ns()
    min_end, max_end = start + int(min_seconds * 1e9), start + int(max_seconds * 1e9)
    while True:
        t0 = time.perf_counter_ns()
        encode(texts, batch_size)
        t1 = time.perf_counter_ns()
        times.append(t1 - t0)
        if (len(times) >= min_calls and t1 >= min_end) or t1 >= max_end:
            break
    wall = (time.perf_counter_ns() - start) / 1e9
    return {"times_ns": times, "wall_s": wall, "own_cpu_s": own_cpu_s() - own0,
            "machine_busy_s": machine_busy_s()[0] - busy0, "items_per_call": len(texts),
            "stopped_by": "rule" if len(times) >= min_calls and wall >= min_seconds else "max_seconds"}


def protocol_channel() -> IO[str]:
    """The channel answers go to: the process's original stdout. fd 1 itself is pointed at stderr, so whatever a
    library prints cannot corrupt the protocol."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def answer_blocks(backends: dict[str, Encode], inputs: dict, ready: dict, out: IO[str], commands: IO[str] | None = None) -> None:
    """The worker's side: answer JSON-lines commands (stdin) until ``quit``: ``block`` (time one backend on one
    workload), ``embed`` (write one backend's embeddings of ``inputs[key]`` to an .npy), ``quit``. Every answer is one
    JSON line; a failing command answers ``ok: false`` with the reason and the worker goes on."""
    print(json.dumps({"ready": True, **ready}), file=out, flush=True)
    for line in commands or sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "quit":
                print(json.dumps({"ok": True}), file=out, flush=True)
                return
            encode = backends[cmd["backend"]]
            if op == "block":
                texts, bs = workload(inputs, cmd["workload"])
                answer = time_block(encode, texts, bs, min_calls=int(cmd["min_calls"]), min_seconds=float(cmd["min_seconds"]),
                                    max_seconds=float(cmd["max_seconds"]), warmup=int(cmd.get("warmup", 1)))
            elif op == "embed":
                emb = np.asarray(encode(list(inputs[cmd.get("key", "texts")]), 32), dtype=np.float32)
                np.save(cmd["out"], emb)
                answer = {"shape": list(emb.shape)}
            else:
                raise ValueError(f"unknown op {op!r}")
            print(json.dumps({"ok": True, **answer}), file=out, flush=True)
        except Exception as e:  # noqa: BLE001 - the controller reports it and goes on
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}), file=out, flush=True)


def warm_and_check(backends: dict[str, Encode], inputs: dict, failed: dict[str, str],
                   lengths_of: Callable[[object, list[str]], list[int]] | None, models: dict) -> dict:
    """One call of every workload per backend (a backend that fails is dropped with the reason), and the token
    lengths each backend's own tokenizer gives the fixed-length workloads (the controller checks they are 128)."""
    tokens: dict[str, dict] = {}
    for name in list(backends):
        try:
            for w in WORKLOADS:
                texts, bs = workload(inputs, w)
                backends[name](texts, bs)
            if lengths_of is not None:
                tokens[name] = {"b32x128": lengths_of(models[name], inputs["b32x128"]),
                                "short": lengths_of(models[name], [inputs["short"]])}
        except Exception as e:  # noqa: BLE001
            failed[name] = f"warm-up failed: {type(e).__name__}: {str(e)[:400]}"
            del backends[name]
    return tokens


class BlockWorker:
    """The controller's handle on one worker process (``answer_blocks`` on its side): ``ask`` a command, get its one
    JSON answer; a worker that dies or stays silent raises with the tail of its log."""

    def __init__(self, side: str, cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> None:
        self.side, self.log = side, log
        self._log = open(log, "w")  # noqa: SIM115 - open for the worker's lifetime
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env, cwd=cwd, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            self.lines.put(line)
        self.lines.put(None)

    def answer(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the {self.side} worker did not answer within {timeout:.0f} s (log: {self.log})") from None
        if line is None:
            tail = " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-4:])
            raise RuntimeError(f"the {self.side} worker exited ({self.proc.wait()}): {tail[-1200:]}")
        return json.loads(line)

    def ask(self, cmd: dict, timeout: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def cpu_s(self) -> float:
        """CPU seconds the worker (and its children) used so far; nan once it is gone."""
        return tree_cpu_s(self.proc.pid) if self.proc.poll() is None else float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"op": "quit"}, 30)
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - it is killed instead
                self.proc.kill()
                self.proc.wait()
        self._log.close()
