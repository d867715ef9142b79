"""``servopt.serve.overload``, the instrument of ``benchmarks/overload.py``: one sample encoded for REST and gRPC, the
open loop that sorts every answer into accepted, refused at admission and dropped after waiting, and the goal's checks
read from a phase and the server's counters."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from servopt.serve import overload as O

META = {"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3, -1]},
                                {"name": "text", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]}


def test_one_sample_is_encoded_once_for_rest_and_for_grpc():
    r = O.make_request(META)
    assert r.rest_path == "/v2/models/m/infer" and r.rest_headers["Content-Type"] == "application/octet-stream"
    n = int(r.rest_headers["Inference-Header-Content-Length"])
    head = json.loads(r.rest_body[:n])
    (x, text), raw = head["inputs"], r.rest_body[n:]
    assert x["shape"] == [1, 3, 16] and x["parameters"]["binary_data_size"] == 1 * 3 * 16 * 4
    assert text["shape"] == [1] and len(raw) == x["parameters"]["binary_data_size"] + text["parameters"]["binary_data_size"]
    assert head["outputs"] == [{"name": "y", "parameters": {"binary_data": True}}]
    assert np.frombuffer(raw[:192], dtype=np.float32).shape == (48,)
    assert r.grpc.model_name == "m" and list(r.grpc.raw_input_contents) == [raw[:192], raw[192:]]


def test_the_open_loop_sorts_answers_into_accepted_refused_and_dropped_and_caps_what_is_in_flight():
    answers = iter(["200", "503", f"503 {O.DROPPED}", "ClientConnectionError"] * 100)

    async def send() -> str:
        return next(answers)

    phase = O.Phase("rest", rate_rps=400.0)
    asyncio.run(O.open_loop(send, "200", {"503"}, phase, 0.2))
    counts = phase.statuses
    assert counts["200"] == len(phase.accepted_ms) and counts["503"] == len(phase.refused_ms)
    assert counts[f"503 {O.DROPPED}"] == len(phase.dropped_ms) and counts["ClientConnectionError"] > 0
    assert sum(counts.values()) > 20 and phase.duration_s >= 0.2

    untouched = O.Phase("rest", rate_rps=400.0)
    asyncio.run(O.open_loop(send, "200", {"503"}, untouched, 0.05, record=False))  # a warm-up records nothing
    assert not untouched.statuses and untouched.duration_s == 0.0

    async def stuck() -> str:
        await asyncio.sleep(0.3)
        return "200"

    capped = O.Phase("grpc", rate_rps=500.0)
    asyncio.run(O.open_loop(stuck, "OK", set(), capped, 0.1, max_in_flight=3))
    assert capped.skipped_by_client > 0 and sum(capped.statuses.values()) == 3, "the client must not become the queue"


def test_the_goal_reads_the_accepted_tail_against_the_budget_the_refusals_speed_and_rss_growth():
    phase = O.Phase("rest", 100.0, duration_s=10.0, accepted_ms=[50.0] * 99 + [1030.0], refused_ms=[2.0] * 50,
                    dropped_ms=[5.0], rss_mb=[(0.0, 200.0), (5.0, 210.0), (10.0, 215.0)])
    counters = {"servopt_compute_seconds_sum": 4.0, "servopt_compute_seconds_count": 100.0, 'servopt_refused_total{reason="wait"}': 50.0,
                "servopt_batch_size_sum": 400.0}
    s = O.summarize(phase, counters, budget_ms=1000.0)
    assert s["server"]["mean_call_ms"] == 40.0 and s["server"]["mean_batch"] == 4.0 and s["server"]["refused"] == {"wait": 50.0}
    assert s["accepted_rps"] == 10.0 and s["rss_mb"]["growth_pct"] == pytest.approx(7.5)
    assert s["goal"] == {"accepted_p99_within_budget_plus_one_call": True, "excess_p99_under_20ms": True,
                         "rss_growth_under_10pct": True}
    slow = O.summarize(O.Phase("grpc", 100.0, duration_s=10.0, accepted_ms=[1100.0] * 10, refused_ms=[30.0] * 10,
                               rss_mb=[(0.0, 200.0), (10.0, 240.0)]), counters, budget_ms=1000.0)
    assert slow["goal"] == {"accepted_p99_within_budget_plus_one_call": False, "excess_p99_under_20ms": False,
                            "rss_growth_under_10pct": False}
