"""The library's one round loop (``bench.rounds``): the sweep's process-by-process re-measure (``bench.alternate``) and
the comparison runner both flip their order every round, and per-round ratios come back as a median with its interval.
No process is started: ``launch`` is replaced by a recorder."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from servopt.bench import alternate as alternate_module
from servopt.bench.alternate import AlternationFailed, alternate
from servopt.bench.launcher import OutOfTime
from servopt.bench.rounds import per_round_ratios, ratio_interval, round_order, side_by_side, take_turns
from servopt.contracts import Latency, Measured, Throughput


def _measured(p50: float, tp: float) -> Measured:
    lat = Latency(p50=p50, p90=p50, p95=p50, p99=p50, mean=p50, stdev=0.0, min=p50, max=p50, n=5, p50_ci95=[p50, p50])
    return Measured(latency_ms=lat, throughput_ips=Throughput(single=1000 / p50, batch=tp))


def _recording_launch(calls: list[tuple[str, float | None]], figures: dict[str, list[tuple[float, float]]]):
    def launch(job, workdir: Path, timeout_s=None, deadline=None):
        name, i = workdir.parent.name, int(workdir.name.removeprefix("round-"))
        calls.append((name, deadline))
        return SimpleNamespace(result=_measured(*figures[name][i]))

    return launch


def test_the_sweeps_alternating_remeasure_flips_its_order_every_round(monkeypatch, tmp_path):
    """bench.alternate used to run ref A B every round, so the reference always ran first."""
    calls: list[tuple[str, float | None]] = []
    figures = {"ref": [(2.0, 100.0), (4.0, 50.0), (2.0, 100.0)], "a": [(1.0, 200.0), (2.0, 100.0), (1.0, 200.0)],
               "b": [(3.0, 80.0), (6.0, 40.0), (3.0, 80.0)]}
    monkeypatch.setattr(alternate_module, "launch", _recording_launch(calls, figures))
    jobs = {n: SimpleNamespace(name=n) for n in ("ref", "a", "b")}
    out = alternate(jobs, 3, tmp_path, deadline=123.0)  # type: ignore[arg-type]
    assert [n for n, _ in calls] == ["ref", "a", "b", "b", "a", "ref", "ref", "a", "b"]
    assert {d for _, d in calls} == {123.0}  # the budget's end reaches every launch
    assert [m.latency_ms.p50 for m in out["b"]] == [3.0, 6.0, 3.0]  # each list in round order, not run order
    got = side_by_side(out, "ref", method="alternating")
    assert got["a"].p50_ratio_vs_reference == 0.5 and got["b"].throughput_ratio_vs_reference == 0.8  # drift cancels


def test_the_alternating_remeasure_stops_on_a_failure_and_on_its_deadline(monkeypatch, tmp_path):
    def failing(job, workdir, timeout_s=None, deadline=None):
        return SimpleNamespace(result=Measured(status="failed", error="it crashed"))

    monkeypatch.setattr(alternate_module, "launch", failing)
    with pytest.raises(AlternationFailed, match=r"ref, round 0: it crashed .*job\.log"):
        alternate({"ref": SimpleNamespace(), "a": SimpleNamespace()}, 2, tmp_path)  # type: ignore[dict-item]

    def out_of_time(job, workdir, timeout_s=None, deadline=None):
        raise OutOfTime("the budget ended")

    monkeypatch.setattr(alternate_module, "launch", out_of_time)
    with pytest.raises(OutOfTime):
        alternate({"ref": SimpleNamespace()}, 2, tmp_path, deadline=0.0)  # type: ignore[dict-item]


def test_take_turns_drops_a_failed_contender_and_stops_when_the_reference_fails():
    def measure(name: str, i: int) -> Measured:
        return Measured(status="failed", error=f"{name} broke") if (name, i) in {("a", 0), ("ref", 1)} else _measured(1.0, 1.0)

    rounds = take_turns(["ref", "a", "b"], 5, measure)
    assert rounds.order == [["ref", "a", "b"], ["b", "ref"]]  # round 2 flipped, without a; then the reference failed
    assert rounds.failed == {"a": "a broke", "ref": "ref broke"}
    assert round_order(["x", "y", "z"], 3) == ["z", "y", "x"]


def test_ratios_come_back_as_a_median_with_its_interval():
    per_round = per_round_ratios([2.0, 4.0, None, 3.0, 5.0, 2.2], [1.0, 2.0, 1.0, 0.0, 5.0, 2.0])
    assert per_round == [2.0, 2.0, 1.0, 1.1]  # round 3 has no figure, round 4 no usable reference
    median, lo, hi, coverage = ratio_interval(per_round)
    assert (median, lo, hi) == (1.55, 1.0, 2.0) and coverage == pytest.approx(14 / 16)  # 4 rounds: the range


def test_the_side_by_side_re_measure_takes_turns_and_gives_its_ratios_intervals(monkeypatch):
    """The sweep's in-process re-measure (``bench.jobs.run_interleave``) runs its rounds through the one round loop: the
    reference first in even rounds, last in odd ones (it never flipped: the same variant ran first every round), and
    each ratio carries its median's interval, which the report shows."""
    from servopt.bench import jobs
    from servopt.bench.protocol import Protocol
    from servopt.bench.stats import Z95, median_interval
    from servopt.contracts import Artifact, Interference, Latency, Phase
    from servopt.data.dataset import Dataset
    from servopt.report.remeasure import interleave_rows

    order: list[str] = []
    speed = {"ref": 10.0, "a": 5.0, "b": 20.0}
    calls = iter(range(10_000))

    def latency(session, data, protocol, name):
        order.append(name.split(":")[0])
        drift = 1 + (next(calls) % 3) * 0.05  # the shared machine, moving between phases
        p = speed[name.split(":")[0]] * drift
        return SimpleNamespace(latency=Latency(p50=p), interference=Interference(), phase=Phase(name=name, start=0, stop=1))

    def batch(session, data, protocol, size, name):
        return SimpleNamespace(throughput=1000 / speed[name.split(":")[0]], interference=Interference(),
                               phase=Phase(name=name, start=0, stop=1))

    monkeypatch.setattr(jobs, "measure_latency", latency)
    monkeypatch.setattr(jobs, "measure_batch", batch)
    monkeypatch.setattr(jobs.OpenSpec, "open", lambda self: SimpleNamespace(warm_up=lambda feed: None))
    monkeypatch.setattr(jobs, "_environment", lambda session: None)
    monkeypatch.setattr(Dataset, "load", staticmethod(lambda path: SimpleNamespace(slice=lambda a, b: {})))
    specs = [jobs.OpenSpec(name=n, artifact=Artifact(format="onnx", path=f"/{n}.onnx"), runtime="onnxruntime")
             for n in ("a", "b", "ref")]
    job = jobs.InterleaveJob(sessions=specs, data="d.npz", reference="ref", protocol=Protocol.quick(), rounds=4)
    il = jobs.run_interleave(job)
    assert order == ["ref", "a", "b", "b", "a", "ref", "ref", "a", "b", "b", "a", "ref"], "the order flips every round"
    a = il.variants["a"]
    ratios = sorted(x / y for x, y in zip(a.p50_ms_rounds, il.variants["ref"].p50_ms_rounds, strict=True))
    assert a.p50_ratio_interval == list(median_interval(ratios, Z95)) and a.ratio_coverage is not None
    row = next(r for r in interleave_rows(il) if r.name == "a")
    assert "[" in row.p50_ratio and row.tp_ratio == "2.00×", row  # throughput steady: no interval worth showing
