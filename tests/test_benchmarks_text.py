"""Pure parts of the text benchmark (benchmarks/text_servers.py, its cells in ``servopt.peers.cells``): no peer
environment, no model. The instruments it imports are tested in test_instruments.py."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import text_servers
from servopt.bench.blocks import workload
from servopt.peers import cells as C

# ------------------------------------------------------------------------------------------ text_servers.py

def test_embeddings_answers_decode_alike() -> None:
    """OpenAI's answer in base64 (little-endian float32) and in floats, rows put back in index order."""
    emb = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    b64 = {"data": [{"index": 1, "embedding": base64.b64encode(emb[1].astype("<f4").tobytes()).decode()},
                    {"index": 0, "embedding": base64.b64encode(emb[0].astype("<f4").tobytes()).decode()}]}
    floats = {"data": [{"index": i, "embedding": row.tolist()} for i, row in enumerate(emb)]}
    assert np.array_equal(C.decode_embeddings(b64), emb)
    assert np.allclose(C.decode_embeddings(floats), emb)


def test_request_bodies_are_the_same_for_both_servers() -> None:
    bodies = C.make_bodies(["a", "b", "c"], 2, 4, seed=0)
    decoded = [json.loads(b) for b in bodies]
    assert all(d["model"] == C.MODEL_NAME and d["encoding_format"] == "base64" and len(d["input"]) == 2 for d in decoded)
    assert sorted(t for d in decoded[:3] for t in d["input"]) == ["a", "a", "b", "b", "c", "c"]  # cycles through the pool
    assert bodies == C.make_bodies(["a", "b", "c"], 2, 4, seed=0)


def test_cells_cover_the_matrix_and_filter() -> None:
    cells = C.cells(50)
    closed = {(c["concurrency"], c["texts"], c["length"]) for c in cells if c["mode"] == "closed" and c["length"] != "shipped"}
    assert closed == {(c, n, length) for c in (1, 8, 32) for n in (1, 16) for length in ("short", "128")}
    assert [c["name"] for c in cells if c["mode"] == "poisson"] == ["poisson50-n1-short"]
    assert "c32-n1-shipped" in [c["name"] for c in cells]  # served vs offline
    assert not [c for c in C.cells(0) if c["mode"] == "poisson"]
    assert [c["name"] for c in C.selected(cells, "c1-n1-*, poisson*")] == ["c1-n1-short", "c1-n1-128", "poisson50-n1-short"]


def test_the_model_alone_bounds_each_closed_cell_with_the_calls_its_requests_could_merge_into() -> None:
    by_name = {c["name"]: c for c in C.cells(50)}
    assert C.model_alone_workload(by_name["c1-n1-short"]) == "pool:short:1"
    assert C.model_alone_workload(by_name["c8-n1-128"]) == "pool:128:8"
    assert C.model_alone_workload(by_name["c1-n16-128"]) == "pool:128:16"
    assert C.model_alone_workload(by_name["c32-n16-short"]) == "pool:short:32"  # servopt's --max-batch
    assert C.model_alone_workload(by_name["poisson50-n1-short"]) is None
    assert C.model_alone_workload(by_name["c32-n1-shipped"]) is None  # served / offline covers it
    from servopt.settings import ServeSettings

    assert ServeSettings().max_batch == C.MAX_BATCH  # a copy (the file runs in Infinity's env): kept equal
    inputs = {"pools": {"short": ["a", "b"], "128": ["c"]}}
    assert workload(inputs, "pool:short:8") == (["a", "b"], 8)
    assert C.block_texts_per_s({"ok": True, "items_per_call": 8, "times_ns": [10**9, 3 * 10**9]}, "w") == 4.0
    with pytest.raises(RuntimeError, match="offline block pool:short:8 failed: boom"):
        C.block_texts_per_s({"ok": False, "error": "boom"}, "pool:short:8")

    def rnd(alone: float, servopt: float, infinity: float) -> dict:
        return {"model_alone": {"pool:128:1": alone},
                "servers": {"servopt": {"cells": {"c1-n1-128": {"texts_per_s": servopt}}},
                            "infinity": {"cells": {"c1-n1-128": {"texts_per_s": infinity}}}}}

    rounds = [rnd(140.0, 100.0, 70.0), rnd(120.0, 90.0, 80.0), rnd(130.0, 110.0, 50.0)]
    s = C.summarize(rounds, ["servopt", "infinity"])["model_alone"]["c1-n1-128"]
    assert s["workload"] == "pool:128:1" and s["texts_per_s"] == 130.0
    assert s["over_infinity"] == 2.0  # per round 2.0, 1.5, 2.6: the most any server of this model could show
    assert s["share"]["servopt"] == 0.75  # per round 0.714, 0.75, 0.846
    rounds[0].pop("model_alone")  # a run from before the model-alone blocks: no row, no error
    assert "c1-n1-128" in C.summarize(rounds, ["servopt"])["model_alone"]
    assert C.summarize([rounds[0]], ["servopt"])["model_alone"] == {}


def test_ratios_are_medians_of_per_round_ratios() -> None:
    assert C.median_ratio([200, 100, 300], [100, 100, 100]) == 2.0
    assert C.median_ratio([None, 100], [100, None]) is None
    rounds = [{"servers": {"servopt": {"cells": {"c": {"req_per_s": 200.0, "texts_per_s": 200.0, "p50_ms": 5.0, "p99_ms": 9.0,
                                                      "server_cpu_ms_per_request": 6.0}}, "start_s": 1.5, "peak_rss_mb": 240.0},
                           "infinity": {"cells": {"c": {"req_per_s": 100.0, "texts_per_s": 100.0, "p50_ms": 10.0, "p99_ms": 9.0,
                                                       "server_cpu_ms_per_request": 20.0}}, "start_s": 19.0, "peak_rss_mb": 2700.0}}}]
    s = C.summarize(rounds, ["servopt", "infinity"])
    assert s["servopt_over_infinity"]["c"] == {"req_per_s": 2.0, "texts_per_s": 2.0, "p50_ms": 0.5, "p99_ms": 1.0, "server_cpu_ms_per_request": 0.3,
                                                "client_cpu_ms_per_request": None}  # not measured in these rounds
    assert s["per_server"]["infinity"]["start_s"] == 19.0 and "servopt_over_servopt-b" not in s
    rounds[0]["servers"]["servopt-b"] = rounds[0]["servers"]["infinity"]  # --servopt-b-args: servopt a second way, same run
    s = C.summarize(rounds, ["servopt", "infinity", "servopt-b"])
    assert s["servopt_over_servopt-b"]["c"] == s["servopt_over_infinity"]["c"]


def test_step_figures_name_the_other_load() -> None:
    """Machine busy minus the server's and the client's CPU is other processes' load (a shared 2-core machine)."""
    from servopt.serve.load.tally import ClientFigures, Percentiles, StepSummary

    client = ClientFigures(cpu_ms_per_request=5.0, cpu_share=0.25, lag_ms=Percentiles.of([0.0]), margin_ms=5.0,
                           behind_share=0.0, unsent=0)
    step = StepSummary(mode="closed", concurrency=8, sender="raw", duration_s=2.0, sent=100, ok=100, refused=0, dropped=0,
                       failed=0, throughput_rps=50.0, latency_ms=Percentiles.of([5.0] * 100), client=client, valid=True,
                       probe=[1.0, 3.0, 0.5])
    fig = C.step_figures(step, 16, ncpu=2)
    assert (fig["req_per_s"], fig["texts_per_s"], fig["server_cpu_ms_per_request"], fig["others_share"]) == (50.0, 800.0, 10.0, 0.375)
    assert fig["client_cpu_ms_per_request"] == 5.0 and fig["p50_ms"] == 5.0
    assert C.step_figures(step.model_copy(update={"probe": [1.0]}), 1)["others_share"] is None


def test_servopt_b_runs_the_other_revisions_code_with_its_own_or_the_shared_options(tmp_path: Path) -> None:
    from types import SimpleNamespace

    env = {"PYTHONPATH": "this/src", "HF_HUB_OFFLINE": "1"}
    rev = SimpleNamespace(servopt_args="--max-queue 1024", servopt_b_args=None)
    assert text_servers.servopt_side("servopt", rev, env, tmp_path) == ("--max-queue 1024", env)
    extra, b_env = text_servers.servopt_side("servopt-b", rev, env, tmp_path)
    assert extra == "--max-queue 1024" and b_env == {**env, "PYTHONPATH": str(tmp_path)}
    setting = SimpleNamespace(servopt_args="--max-queue 1024", servopt_b_args="--threads 1")
    assert text_servers.servopt_side("servopt-b", setting, env, None) == ("--threads 1", env)


def test_a_server_s_cells_are_loaded_by_the_load_generator(tmp_path: Path) -> None:
    """``measure_server`` runs each selected cell through ``serve.load`` (a closed loop, a Poisson one) against a
    server answering ``/v1/embeddings``, and turns each step into the cell's figures."""
    from servopt.serve.harness import AppProcess, free_port

    port = free_port()
    code = ("import asyncio\n"
            "async def h(r, w):\n"
            "    while True:\n"
            "        try:\n"
            "            head = await r.readuntil(b'\\r\\n\\r\\n')\n"
            "        except Exception:\n"
            "            return\n"
            "        body = await r.readexactly(int(head.lower().split(b'content-length: ')[1].split(b'\\r\\n')[0]))\n"
            "        out = b'{}' if head.startswith(b'POST /v1/embeddings') and body else b'ready'\n"
            "        w.write(b'HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n%s' % (len(out), out))\n"
            "        await w.drain()\n"
            "async def main():\n"
            f"    s = await asyncio.start_server(h, '127.0.0.1', {port})\n"
            "    async with s:\n"
            "        await s.serve_forever()\n"
            "asyncio.run(main())\n")
    with AppProcess([sys.executable, "-c", code], port, ready_path="/v1/embeddings", ready_body=b"{}") as app:
        srv = C.Running(url=app.url, pid=app.proc.pid, start_s=app.start_s, stop=app.stop)
        pools = {"short": ["a cat", "a dog sat"], "128": ["x " * 60], "shipped": ["one", "two"]}
        out = C.measure_server(srv, "fake", pools, 0, rate=50.0, patterns="c1-n1-short,poisson*", seconds=0.4, warmup=0.1)
    assert set(out) == {"c1-n1-short", "poisson50-n1-short"}
    for fig in out.values():
        assert fig["ok"] > 5 and not fig["errors"] and fig["server_cpu_s"] >= 0 and fig["client_cpu_ms_per_request"] is not None
