"""The cheap HTTP client of the benchmarks (closed and Poisson loops): keep-alive HTTP/1.1 over asyncio streams, requests built once as bytes.

Written by hand because the load client shares the machine's 2 cores with the server it measures: every millisecond of
CPU it spends per request is taken from the server, and a CPU-bound server's requests/s falls with it. aiohttp spent
0.36-0.42 ms of CPU per one-sentence embeddings request here, this client 0.12-0.13 ms (AMD EPYC AVX2, against
``servopt serve`` at concurrency 32: the server then answered 1.10-1.23x the requests/s; docs/benchmarks.md). It
speaks only what the servers it measures answer: a status line, headers, a body by Content-Length or in chunks; a
connection the server closed while idle (uvicorn's keep-alive timeout, 5 s: a client done with its phase waits for
the slowest) is opened again before the next request; one closed under a request counts as an error of its kind.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from urllib.parse import urlsplit


def request_bytes(url: str, body: bytes, content_type: str = "application/json") -> bytes:
    """One POST to ``url`` (``http://host:port/path``) carrying ``body``, as the bytes sent on the wire."""
    parts = urlsplit(url)
    head = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """Status, body and whether the server asked to close, of the next answer on ``reader``."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    close = b"connection: close" in lower
    at = lower.find(b"content-length:")
    if at >= 0:
        length = int(lower[at + 15:lower.index(b"\r\n", at)])
        return status, await reader.readexactly(length), close
    if b"transfer-encoding: chunked" not in lower:
        raise ConnectionError(f"an answer without Content-Length or chunks: {head[:200]!r}")
    body = b""
    while size := int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readuntil(b"\r\n")
    return status, body, close


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
NETWORK_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError)


async def exchange(conn: Conn, wire: bytes) -> tuple[str, bool]:
    """Send one request on ``conn`` and read its answer: (its status, or the exception's name; whether to close)."""
    try:
        conn[1].write(wire)
        status, _, close = await asyncio.wait_for(read_answer(conn[0]), 120)
        return str(status), close
    except NETWORK_ERRORS as e:
        return type(e).__name__, True


class Tally:
    """Latencies (ms) of the requests answered 200, and the others counted by status or exception name."""

    def __init__(self) -> None:
        self.latencies_ms: list[float] = []
        self.errors: dict[str, int] = {}

    def add(self, kind: str, t0: float, record: bool) -> None:
        if record and kind == "200":
            self.latencies_ms.append((time.perf_counter() - t0) * 1000)
        elif record:
            self.errors[kind] = self.errors.get(kind, 0) + 1


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, duration: float, warmup: float,
                      probe: Callable[[], tuple[float, ...]] = lambda: (0.0,)) -> dict:
    """``concurrency`` keep-alive connections, each sending the next body (in turn from ``bodies``) as soon as its answer
    is in: ``warmup`` seconds untimed, then ``duration`` timed. ``probe()`` (CPU counters) is read as the timed part
    starts and ends. Returns the requests answered 200, their latencies (ms), the others by status or exception name."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    wires = [request_bytes(url, b) for b in bodies]
    counter = iter(range(10**12))
    tally = Tally()
    conns: list[Conn | None] = [None] * concurrency

    async def client(i: int, until: float, record: bool) -> None:
        """Requests until ``until`` (the last one is waited for)."""
        while time.perf_counter() < until:
            conn = conns[i]
            if conn is not None and conn[0].at_eof():  # closed by the server while idle (keep-alive timeout)
                conn[1].close()
                conn = None
            if conn is None:
                conn = conns[i] = await asyncio.open_connection(host, port)
            t0 = time.perf_counter()
            kind, close = await exchange(conn, wires[next(counter) % len(wires)])
            tally.add(kind, t0, record)
            if close:
                conn[1].close()
                conns[i] = None

    try:
        if warmup > 0:
            end = time.perf_counter() + warmup
            await asyncio.gather(*(client(i, end, False) for i in range(concurrency)))
        p0, start = probe(), time.perf_counter()
        await asyncio.gather(*(client(i, start + duration, True) for i in range(concurrency)))
        wall = time.perf_counter() - start
        deltas = [b - a for a, b in zip(p0, probe(), strict=True)]
    finally:
        for conn in conns:
            if conn is not None:
                conn[1].close()
    return {"wall_s": wall, "ok": len(tally.latencies_ms), "errors": tally.errors, "latencies_ms": tally.latencies_ms,
            "cpu_deltas": deltas}


async def poisson_loop(url: str, bodies: list[bytes], rate: float, duration: float, warmup: float, seed: int,
                       probe: Callable[[], tuple[float, ...]] = lambda: (0.0,), max_in_flight: int = 512) -> dict:
    """Open loop: requests sent at Poisson arrivals of ``rate``/s whatever the answers do (MLPerf's server scenario),
    each on a connection of a pool (opened as needed, kept alive); past ``max_in_flight`` outstanding requests an
    arrival is dropped and counted, never queued in the client. Returns what ``closed_loop`` does, plus
    ``dropped_by_client``."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    wires = [request_bytes(url, b) for b in bodies]
    rng = random.Random(seed)
    tally = Tally()
    dropped = [0]
    idle: list[Conn] = []
    opened: list[asyncio.StreamWriter] = []

    async def one(wire: bytes, record: bool) -> None:
        conn = None
        while idle and conn is None:
            conn = idle.pop()
            if conn[0].at_eof():  # closed by the server while idle
                conn[1].close()
                conn = None
        t0 = time.perf_counter()
        if conn is None:
            try:
                conn = await asyncio.open_connection(host, port)
            except OSError as e:
                tally.add(type(e).__name__, t0, record)
                return
            opened.append(conn[1])
        kind, close = await exchange(conn, wire)
        tally.add(kind, t0, record)
        if close:
            conn[1].close()
        else:
            idle.append(conn)

    async def run(length: float, record: bool) -> float:
        tasks: set[asyncio.Task] = set()
        start = t = time.perf_counter()
        k = 0
        while t < start + length:
            t += rng.expovariate(rate)
            delay = t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= max_in_flight:
                dropped[0] += record
                continue
            task = asyncio.create_task(one(wires[k % len(wires)], record))
            k += 1
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks), timeout=120)
        return time.perf_counter() - start

    try:
        if warmup > 0:
            await run(warmup, False)
        p0 = probe()
        wall = await run(duration, True)
        deltas = [b - a for a, b in zip(p0, probe(), strict=True)]
    finally:
        for writer in opened:
            writer.close()
    return {"wall_s": wall, "ok": len(tally.latencies_ms), "errors": tally.errors, "latencies_ms": tally.latencies_ms,
            "dropped_by_client": dropped[0], "cpu_deltas": deltas}
