"""The senders the load generator can send with, one file each (``base.SENDERS``): ``raw`` (the cheapest, the
default), ``aiohttp`` and ``grpc``."""

from servopt.serve.load.senders import aiohttp_client, grpc_client, raw  # noqa: F401  (each registers itself)
