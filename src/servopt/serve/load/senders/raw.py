"""The cheapest sender (the default): keep-alive HTTP/1.1 over asyncio streams, each request's bytes built once.

Written by hand because the load client shares the machine's cores with the server it measures: every millisecond of
CPU it spends per request is taken from the server, and a CPU-bound server's requests/s falls with it. aiohttp spent
0.36-0.42 ms of CPU per one-sentence embeddings request here, this client 0.12-0.13 ms (AMD EPYC AVX2, against
``servopt serve`` at concurrency 32: the server then answered 1.10-1.23x the requests/s; docs/benchmarks.md). It
speaks only what the servers it measures answer: a status line, headers, a body by Content-Length or in chunks. A
pool of connections, opened as needed and kept alive; one the server closed while idle (uvicorn's keep-alive
timeout, 5 s) is opened again; one closed under a request is that request's error.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

from servopt.serve.load.requests import Request
from servopt.serve.load.senders.base import Answer, Kind, Sender, http_answer, register_sender

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
NETWORK_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError)


def request_bytes(host: str, request: Request, api_key: str | None = None) -> bytes:
    """``request`` as the bytes sent on the wire to ``host`` (``host:port``)."""
    head = f"POST {request.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {request.content_type}\r\n"
    for name, value in request.headers:
        head += f"{name}: {value}\r\n"
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    return (head + f"Content-Length: {len(request.body)}\r\n\r\n").encode() + request.body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """Status, body and whether the server asked to close, of the next answer on ``reader``."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    close = b"connection: close" in lower
    at = lower.find(b"\r\ncontent-length:")  # a header of its own: not Inference-Header-Content-Length's tail
    if at >= 0:
        length = int(lower[at + 17:lower.index(b"\r\n", at + 2)])
        return status, await reader.readexactly(length), close
    if b"transfer-encoding: chunked" not in lower:
        raise ConnectionError(f"an answer without Content-Length or chunks: {head[:200]!r}")
    body = b""
    while size := int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readuntil(b"\r\n")
    return status, body, close


@register_sender
class RawHttp(Sender):
    """Keep-alive HTTP/1.1 over asyncio streams, a pool of connections opened as needed."""

    name = "raw"

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 60.0) -> None:
        super().__init__(url, api_key, timeout_s)
        parts = urlsplit(self.url)
        self.host, self.netloc = parts.hostname or "127.0.0.1", parts.netloc
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.idle: list[Conn] = []
        self.opened: set[asyncio.StreamWriter] = set()  # every connection open now, closed at the end
        self.wires: dict[int, bytes] = {}  # id(request) → its bytes: requests live in the pool for the whole run

    def wire(self, request: Request) -> bytes:
        key = id(request)
        if key not in self.wires:
            self.wires[key] = request_bytes(self.netloc, request, self.api_key)
        return self.wires[key]

    async def send(self, request: Request) -> Answer:
        wire = self.wire(request)
        conn = None
        while self.idle and conn is None:
            conn = self.idle.pop()
            if conn[0].at_eof():  # closed by the server while idle
                self._drop(conn)
                conn = None
        try:
            if conn is None:
                conn = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, ssl=self.ssl), self.timeout_s)
                self.opened.add(conn[1])
            conn[1].write(wire)
            status, body, close = await asyncio.wait_for(read_answer(conn[0]), self.timeout_s)
        except NETWORK_ERRORS as e:
            if conn is not None:
                self._drop(conn)
            return Answer(Kind.ERROR, type(e).__name__)
        if close:
            self._drop(conn)
        else:
            self.idle.append(conn)
        return http_answer(status, body)

    def _drop(self, conn: Conn) -> None:
        conn[1].close()
        self.opened.discard(conn[1])

    async def close(self) -> None:
        for writer in self.opened:
            writer.close()
        self.idle.clear()
        self.opened.clear()
