"""Run the server: one data plane, the REST front end, and the gRPC front end when a port is given."""

from __future__ import annotations

from servopt.serve.dataplane import DataPlane
from servopt.serve.model import ServedModel
from servopt.settings import ServeSettings


def run_server(models: dict[str, ServedModel], settings: ServeSettings) -> None:
    import uvicorn

    from servopt.serve.rest import create_app

    plane = DataPlane(models, settings)
    frontends = []
    if settings.grpc_port:
        from servopt.serve.grpc_server import GrpcFrontend

        frontends.append(GrpcFrontend(plane, settings.host, settings.grpc_port))
    app = create_app(plane, frontends=frontends)
    # uvicorn's "auto" loop and HTTP parser are uvloop and httptools, which uvicorn[standard] installs (the pure-Python
    # asyncio loop and h11 cost several times their CPU per request). No access log: a log call per request is CPU on
    # the serving path, and /metrics counts every request by route and status.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", access_log=False, loop="auto", http="auto",
                timeout_graceful_shutdown=int(settings.request_timeout_s) + 5, limit_concurrency=settings.limit_concurrency)
