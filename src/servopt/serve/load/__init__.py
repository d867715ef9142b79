"""The one load generator (like MLPerf LoadGen): a schedule (``run.Closed``, ``run.Open``) × a sender
(``senders``: ``raw``, the cheapest and the default; ``aiohttp``; ``grpc``) × one tally (``tally``: accepted,
refused, dropped, errors; latency from each request's scheduled time; the client's own CPU and lag), the requests
encoded once (``requests``), and LoadGen's early-stopping rule for a percentile claim (``earlystop``)."""

from servopt.serve.load.earlystop import Claim, claim, queries_for
from servopt.serve.load.requests import Pool, Request
from servopt.serve.load.run import Closed, Open, Schedule, run
from servopt.serve.load.senders.base import Answer, Kind, Sender, open_sender
from servopt.serve.load.tally import StepSummary, Tally

__all__ = ["Answer", "Claim", "Closed", "Kind", "Open", "Pool", "Request", "Schedule", "Sender", "StepSummary", "Tally",
           "claim", "open_sender", "queries_for", "run"]
