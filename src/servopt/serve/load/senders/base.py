"""A sender: how one request reaches the server and how its answer is read, in one word (``Kind``) that every
tally, loop and report shares: accepted, refused at admission, dropped after waiting, or an error of its kind.

A sender is an async context (its connections opened as needed, closed at the end) with one method, ``send``. Each
registers itself by name in ``SENDERS``; the load generator picks one (``open_sender``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, Self

from servopt.errors import UserError
from servopt.serve.load.requests import Request


class Kind(StrEnum):
    """What became of a request, in the one set of words every tally and report uses."""

    ACCEPTED = "accepted"  # answered with the result (HTTP 200, gRPC OK)
    REFUSED = "refused"  # refused at admission: the server's fast answer to overload (HTTP 503/429, RESOURCE_EXHAUSTED)
    DROPPED = "dropped"  # admitted, then dropped for waiting past the server's latency budget (503, its message says so)
    ERROR = "error"  # anything else: another status, a broken connection, no answer in time


@dataclass(frozen=True)
class Answer:
    """One answer: its kind, and the status it came with."""

    kind: Kind
    status: str  # "200", "503", "OK", "RESOURCE_EXHAUSTED", or the exception's name


DROPPED_MARK = b"dropped after waiting"  # in the server's message (serve/batcher.py) when it dropped a queued request


def http_answer(status: int, body: bytes) -> Answer:
    """An HTTP answer in the load generator's words."""
    if status == 200:
        return Answer(Kind.ACCEPTED, "200")
    if status == 503 and DROPPED_MARK in body:
        return Answer(Kind.DROPPED, "503 dropped")
    if status in (503, 429):
        return Answer(Kind.REFUSED, str(status))
    return Answer(Kind.ERROR, f"http {status}")


class Sender(ABC):
    """Sends requests to one server (``url``: ``http(s)://host:port``, or ``host:port`` for gRPC)."""

    name: ClassVar[str]

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:  # a sender without connections of its own has nothing to close
        pass

    @abstractmethod
    async def send(self, request: Request) -> Answer:
        """Send ``request``, read its whole answer; never raises for what the server or the network did."""


SENDERS: dict[str, type[Sender]] = {}


def register_sender(cls: type[Sender]) -> type[Sender]:
    SENDERS[cls.name] = cls
    return cls


def open_sender(name: str, url: str, api_key: str | None = None, timeout_s: float = 60.0) -> Sender:
    import servopt.serve.load.senders  # noqa: F401  (the built-in senders register themselves)

    if name not in SENDERS:
        raise UserError(f"unknown sender {name!r}", fix=f"use one of: {', '.join(sorted(SENDERS))}")
    return SENDERS[name](url, api_key, timeout_s)
