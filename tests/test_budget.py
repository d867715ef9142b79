"""The time budget as one object (``optimize.budget.Budget``, issue 40): planned from this run's own costs, the
capacity search's time reserved from the start, each stage's use timed, and the plan with what it skipped reported."""

from __future__ import annotations

import time

import pytest

from conftest import no_budget
from servopt.contracts import Latency, Throughput
from servopt.optimize import racing
from servopt.optimize.budget import STAGES
from servopt.optimize.targets import PRESETS
from servopt.optimize.variants import Variant
from test_racing import rec

CPU_SERVER = PRESETS["cpu-server"]  # names an 8-vCPU instance, a price and a p99 SLO: served and priced


def budget(seconds: float | None = 300, elapsed: float = 0.0, capacity: bool = True):
    b = no_budget(seconds, [CPU_SERVER, PRESETS["edge"]], elapsed)
    b.capacity_probe = capacity
    return b


@pytest.mark.isa
def test_the_finish_is_planned_from_the_baseline_s_own_calls():
    """Before the baseline is measured the plan guesses a turn; once it is, a slower machine's calls make every
    reserve of the finish larger (an AVX2 Zen 3 twice as slow: half the figures, twice the seconds)."""
    b = budget()
    assert b.remeasure_turn() == 4.0 and b.batch_call_seconds() == 0.0
    fast = rec("ort-fp32", 5.0, 200).model_copy(update={"batch_latency_ms": Latency(p50=160.0)})
    b.observe_baseline(fast)
    quick = b.reserves(3)
    b.observe_baseline(rec("ort-fp32", 40.0, 25).model_copy(update={"throughput_ips": Throughput(batch=25)}))
    slow = b.reserves(3)
    assert b.batch_call_seconds() == pytest.approx(4 / 25)  # the quick protocol's batch of 4 at 25/s
    assert slow["re-measure"] > quick["re-measure"] and slow["capacity"] == quick["capacity"] == racing.CAPACITY_RESERVE_SECONDS
    b.observe_baseline(rec("ort-fp32", 1.0, 1000).model_copy(update={"status": "failed"}))
    assert b.batch_call_seconds() == pytest.approx(4 / 25), "a failed record is no cost of this machine"


def test_the_capacity_search_is_reserved_from_the_start():
    """A screening job's deadline and a re-measure's leave the capacity search and the closing their reserves; the
    capacity search's leaves the closing's; a profile ends where the report's seconds begin. Without a probe nothing is served,
    so nothing is kept for it."""
    b = budget(300)
    closing, capacity = b.closing(), b.capacity_reserve()
    assert capacity == racing.CAPACITY_RESERVE_SECONDS and closing == racing.closing_seconds(2)
    now = time.time()
    variant = Variant("ort-int8", "int8", "onnxruntime")
    assert b.deadline(variant) - now == pytest.approx(300 - closing - capacity, abs=1)
    assert b.finish_deadline() - now == pytest.approx(300 - closing - capacity, abs=1)
    assert b.finish_deadline("capacity") - now == pytest.approx(300 - closing, abs=1)
    report = racing.closing_seconds(0)  # the command renders the report once the sweep returns
    assert b.finish_deadline("closing") - now == pytest.approx(300 - report, abs=1)
    assert b.deadline(Variant("ort-fp32", "onnxruntime", "onnxruntime", role="baseline")) is None, "measured whatever it is"
    assert budget(300, capacity=False).capacity_reserve() == 0.0
    assert budget(None).deadline(variant) is None and budget(None).finish_deadline() is None


@pytest.mark.isa
def test_what_fits_keeps_every_later_stage_s_reserve(monkeypatch):
    """A variant fits only if the finish still fits after it: with 60 s left and the finish's reserves above that,
    nothing does; with 240 s left the first few do, and fewer as contenders pile up (each one more to re-measure).
    A CPU richer than cpu-server's AVX2 also re-measures its candidates capped, so fewer fit there. The CPU and its
    cores are injected: the reserves follow both (with 290 s left an AVX2 reading fitted 8 whatever the contenders:
    the re-measure's reserve stops growing at six candidates)."""
    import servopt.bench.scaling
    import servopt.optimize.budget
    from servopt.cpu import CpuFeatures

    monkeypatch.setattr(servopt.bench.scaling, "machine_cores", lambda: 2)  # the scaling's reserve grows with the cores
    units = [type("U", (), {"variant": Variant(f"v{i}", "int8", "onnxruntime")})() for i in range(10)]
    fitted = {}
    for flags in ({"avx2", "fma"}, {"avx2", "fma", "avx512f", "avx512_vnni"}):
        cpu = CpuFeatures(frozenset(flags))
        monkeypatch.setattr(servopt.optimize.budget, "cpu_features", lambda cpu=cpu: cpu)
        late = budget(300, elapsed=240)
        assert late.fits(units, 0, "torch-eager") == 0
        early = budget(300, elapsed=60)
        many = early.fits(units, 0, "torch-eager")
        assert 0 < many < len(units)
        assert early.fits(units, 4, "torch-eager") < many
        fitted[cpu.level] = many
    assert fitted["avx512_vnni"] < fitted["avx2"], "the capped re-measure's reserve"
    assert budget(None).fits(units, 99, "torch-eager") == len(units)


@pytest.mark.isa
def test_the_plan_says_what_each_stage_used_and_skipped():
    b = budget(300)
    with b.stage("screening"):
        time.sleep(0.01)
    with b.stage("screening"):
        pass
    b.skip("screening", "torch-compile")
    plan = b.plan(2)
    assert [s.stage for s in plan.stages] == list(STAGES)
    screening = next(s for s in plan.stages if s.stage == "screening")
    assert screening.used_s is not None and screening.skipped == ["torch-compile"]
    assert next(s for s in plan.stages if s.stage == "capacity").planned_s == racing.CAPACITY_RESERVE_SECONDS
    assert next(s for s in plan.stages if s.stage == "scaling").used_s is None, "did not run"
    assert sum(s.planned_s for s in plan.stages) == pytest.approx(300, abs=1)
    assert budget(None).plan(2) is None


@pytest.mark.isa
def test_the_report_shows_the_plan_beside_its_use():
    from types import SimpleNamespace

    from servopt.report.budget import budget_section

    b = budget(300)
    with b.stage("original"):
        pass
    b.skip("re-measure", "the cold start of torch-eager (beaten beyond noise)")
    section = budget_section(SimpleNamespace(budget=b.plan(2), wall_s=281.0))
    assert "281 s used" in section.summary and "capacity search's" in section.summary
    rows = {r.stage: r for r in section.rows}
    assert rows["capacity"].planned == f"{racing.CAPACITY_RESERVE_SECONDS:.0f} s" and rows["capacity"].used == "–"
    assert rows["re-measure"].skipped == "the cold start of torch-eager (beaten beyond noise)"
    assert budget_section(SimpleNamespace(budget=None, wall_s=1.0)) is None


@pytest.mark.isa
def test_a_capped_re_measure_is_reserved_only_for_a_runtime_it_applies_to(monkeypatch):
    """cpu-server names an AVX2 EPYC: on a richer machine its candidates are re-measured held to AVX2, but ONNX
    Runtime cannot be (its figures stand uncapped), so a race of ONNX Runtime contenders reserves no such run; one
    OpenVINO or PyTorch contender brings it back."""
    from servopt import machine

    monkeypatch.setattr(machine, "_cpuinfo_lines", lambda: ["flags\t: avx2 fma avx512f avx512_vnni\n"])
    monkeypatch.delenv(machine.READ_AS_ENV, raising=False)
    b = budget(300)
    assert b.poorer_isas() == {"avx2"} and not b.cappable("onnxruntime") and b.cappable("openvino")
    assert b.reserves(2, cappable=False)["re-measure"] < b.reserves(2, cappable=True)["re-measure"]
    units = [type("U", (), {"variant": Variant(f"v{i}", "int8", "onnxruntime")})() for i in range(10)]
    assert b.fits(units, 0, "torch-eager", cappable=False) >= b.fits(units, 0, "torch-eager", cappable=True)
