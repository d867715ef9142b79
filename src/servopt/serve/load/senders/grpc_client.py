"""OIP v2 over gRPC (``grpc.aio``): ``ModelInfer`` with each request's ``ModelInferRequest`` (``Request.grpc``), to a
server's ``--grpc-port`` (``url``: ``host:port``). Overload reads as its status codes: RESOURCE_EXHAUSTED and
UNAVAILABLE refused, and dropped when the message says the request waited past the budget."""

from __future__ import annotations

from servopt.errors import UserError
from servopt.serve.load.requests import Request
from servopt.serve.load.senders.base import DROPPED_MARK, Answer, Kind, Sender, register_sender

REFUSED = {"RESOURCE_EXHAUSTED", "UNAVAILABLE"}


@register_sender
class GrpcSender(Sender):
    """One ``grpc.aio`` channel and its inference stub."""

    name = "grpc"

    async def __aenter__(self) -> GrpcSender:
        import grpc

        from servopt.serve.proto import grpc_service_pb2_grpc as pb_grpc

        target = self.url.split("://", 1)[-1]
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.rpc_error = grpc.aio.AioRpcError
        self.metadata = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None
        return self

    async def send(self, request: Request) -> Answer:
        if request.grpc is None:
            raise UserError(f"{request.path} has no gRPC form", fix="send tensors or texts over gRPC, images over HTTP")
        try:
            await self.stub.ModelInfer(request.grpc, timeout=self.timeout_s, metadata=self.metadata)
            return Answer(Kind.ACCEPTED, "OK")
        except self.rpc_error as e:
            code = e.code().name
            if code in REFUSED and DROPPED_MARK.decode() in (e.details() or ""):
                return Answer(Kind.DROPPED, f"{code} dropped")
            return Answer(Kind.REFUSED if code in REFUSED else Kind.ERROR, code)

    async def close(self) -> None:
        if getattr(self, "channel", None) is not None:
            await self.channel.close()
