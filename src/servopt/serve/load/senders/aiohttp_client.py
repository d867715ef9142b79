"""aiohttp as the sender: for a server the raw sender cannot speak to (HTTP/2 only, a proxy's redirects, auth schemes
beyond a bearer token). It costs the shared cores about three times the raw sender's CPU per request (0.36-0.42 ms
against 0.12-0.13 ms here, ``raw.py``), which a server measured on the same cores loses."""

from __future__ import annotations

from servopt.serve.load.requests import Request
from servopt.serve.load.senders.base import Answer, Kind, Sender, http_answer, register_sender


@register_sender
class AiohttpSender(Sender):
    """One aiohttp session, unlimited keep-alive connections."""

    name = "aiohttp"

    async def __aenter__(self) -> AiohttpSender:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        self.errors: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError)
        return self

    async def send(self, request: Request) -> Answer:
        headers = {"Content-Type": request.content_type, **dict(request.headers)}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            async with self.session.post(self.url + request.path, data=request.body, headers=headers) as r:
                return http_answer(r.status, await r.read())
        except self.errors as e:
            return Answer(Kind.ERROR, type(e).__name__)

    async def close(self) -> None:
        if getattr(self, "session", None) is not None:
            await self.session.close()
