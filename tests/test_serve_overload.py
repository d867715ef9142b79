"""``servopt.serve.overload``, the instrument of ``benchmarks/overload.py``: one sample encoded for REST and gRPC, the
goal's checks read from a phase (the load generator's step) and the server's counters. The open loop itself, its
words for answers and its cap are ``serve.load``'s (tests/test_load.py)."""

from __future__ import annotations

import json

import pytest

from servopt.serve import overload as O
from servopt.serve.load.tally import ClientFigures, Percentiles, StepSummary

META = {"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3, -1]},
                                {"name": "text", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]}


def test_one_sample_is_encoded_once_for_rest_and_for_grpc():
    r = O.make_request(META)
    n = int(dict(r.headers)["Inference-Header-Content-Length"])
    (x, text) = json.loads(r.body[:n])["inputs"]
    assert r.path == "/v2/models/m/infer" and x["shape"] == [1, 3, 16] and text["shape"] == [1]
    assert r.grpc.model_name == "m" and b"".join(r.grpc.raw_input_contents) == r.body[n:]


def _phase(sender: str, accepted: list[float], refused: list[float], dropped: list[float]) -> StepSummary:
    client = ClientFigures(cpu_ms_per_request=0.1, cpu_share=0.05, lag_ms=Percentiles.of([0.1]), margin_ms=5.0,
                           behind_share=0.0, unsent=0)
    return StepSummary(mode="open-poisson", rate_rps=100.0, sender=sender, duration_s=10.0,
                       sent=len(accepted) + len(refused) + len(dropped), ok=len(accepted), refused=len(refused),
                       dropped=len(dropped), failed=0, errors={"503": len(refused)} if refused else {},
                       throughput_rps=len(accepted) / 10.0, latency_ms=Percentiles.of(accepted),
                       refused_ms=Percentiles.of(refused) if refused else None,
                       dropped_ms=Percentiles.of(dropped) if dropped else None, client=client, valid=True)


def test_the_goal_reads_the_accepted_tail_against_the_budget_the_refusals_speed_and_rss_growth():
    counters = {"servopt_compute_seconds_sum": 4.0, "servopt_compute_seconds_count": 100.0, 'servopt_refused_total{reason="wait"}': 50.0,
                "servopt_batch_size_sum": 400.0}
    phase = _phase("raw", [50.0] * 99 + [1030.0], [2.0] * 50, [5.0])
    s = O.summarize(phase, counters, 1000.0, [(0.0, 200.0), (5.0, 210.0), (10.0, 215.0)])
    assert s["protocol"] == "rest" and s["statuses"] == {"accepted": 100, "503": 50}
    assert s["server"]["mean_call_ms"] == 40.0 and s["server"]["mean_batch"] == 4.0 and s["server"]["refused"] == {"wait": 50.0}
    assert s["accepted_rps"] == 10.0 and s["rss_mb"]["growth_pct"] == pytest.approx(7.5) and s["dropped"]["count"] == 1
    assert s["goal"] == {"accepted_p99_within_budget_plus_one_call": True, "excess_p99_under_20ms": True,
                         "rss_growth_under_10pct": True}
    slow = O.summarize(_phase("grpc", [1100.0] * 10, [30.0] * 10, []), counters, 1000.0, [(0.0, 200.0), (10.0, 240.0)])
    assert slow["protocol"] == "grpc"
    assert slow["goal"] == {"accepted_p99_within_budget_plus_one_call": False, "excess_p99_under_20ms": False,
                            "rss_growth_under_10pct": False}


@pytest.mark.slow
def test_an_overload_phase_runs_on_rest_and_grpc(tmp_path):
    """The instrument end to end on a tiny model: the closed-loop maximum, then a phase of Poisson arrivals on each
    protocol through the load generator's raw and gRPC senders, with the server's counters and RSS."""
    import asyncio

    import httpx

    from conftest import tiny_classifier_onnx
    from servopt.serve.harness import ServerProcess

    model = tiny_classifier_onnx(tmp_path / "tiny.onnx", ["a", "b", "c"])
    with ServerProcess(model, "--name", "m", "--latency-budget-ms", "200", grpc=True) as server:
        request = O.make_request(httpx.get(f"{server.url}/v2/models/m", timeout=10).json())
        top, seen = asyncio.run(O.max_rate(server.url, request, 0.5, 4))
        assert top > 0 and seen["accepted"] > 0
        for protocol in ("rest", "grpc"):
            phase = asyncio.run(O.overload(server, request, protocol, 50.0, 1.0, 0.2, 200.0))
            assert phase["protocol"] == protocol and phase["statuses"]["accepted"] > 10, phase
            assert phase["server"]["model_calls"] > 0 and phase["rss_mb"]["start"] > 0 and set(phase["goal"]) == {
                "accepted_p99_within_budget_plus_one_call", "excess_p99_under_20ms", "rss_growth_under_10pct"}
