"""The projection from this machine's cores to a target's instance, against curves whose law is known."""

from __future__ import annotations

import pytest

from conftest import no_budget
from servopt.contracts import ScalingCurve, ScalingPoint
from servopt.optimize.scaling import (
    Amdahl,
    Served,
    Usl,
    band,
    fit_amdahl,
    fit_usl,
    project_latency,
    project_throughput,
    why_not,
)


def curve(throughput: dict[int, list[float]], p50: dict[int, list[float]] | None = None) -> ScalingCurve:
    p50 = p50 or {n: [10.0 / n] * len(v) for n, v in throughput.items()}
    return ScalingCurve(variant="v", batch_size=32, points=[
        ScalingPoint(cores=n, instances=n, threads_per_instance=1, throughput_ips=throughput[n], p50_ms=p50[n]) for n in throughput])


def test_usl_recovers_a_known_law_from_four_points():
    law = Usl(100.0, 0.05, 0.002)
    fit = fit_usl([1, 2, 3, 4], [law(n) for n in (1, 2, 3, 4)])
    assert fit.sigma == pytest.approx(0.05, abs=1e-9) and fit.kappa == pytest.approx(0.002, abs=1e-9)
    assert fit(8) == pytest.approx(law(8))


def test_two_points_fit_amdahl_throughput_and_say_so():
    law = Usl(100.0, 0.1, 0.0)
    fit = fit_usl([1, 2], [law(1), law(2)])
    assert fit.kappa == 0 and fit.sigma == pytest.approx(0.1)
    assert fit(8) == pytest.approx(100 * 8 / (1 + 0.1 * 7))
    assert "two points" in fit.describe(2)


def test_superlinear_points_are_held_to_linear():
    fit = fit_usl([1, 2], [100.0, 230.0])  # 2.3x on two cores: a cache effect, not a law to extrapolate
    assert fit.sigma == 0 and fit(8) == pytest.approx(800.0)


def test_amdahl_latency_recovers_the_parallel_share():
    law = Amdahl(10.0, 0.8)
    fit = fit_amdahl([1, 2, 4], [law(1), law(2), law(4)])
    assert fit.p == pytest.approx(0.8)
    assert fit(8) == pytest.approx(10 * (0.2 + 0.8 / 8))


def test_projection_of_a_noiseless_curve_is_exact_and_its_interval_collapses():
    law = Usl(100.0, 0.1, 0.0)
    c = curve({1: [law(1)] * 3, 2: [law(2)] * 3}, {1: [10.0] * 3, 2: [6.0] * 3})
    tp = project_throughput(c, 8)
    assert tp is not None and tp.value == pytest.approx(law(8)) and tp.low == pytest.approx(tp.high)
    assert not tp.measured and tp.cores_measured == [1, 2] and "projected from 2 vCPU counts" in tp.note
    lat = project_latency(c, 8)  # T2/T1 = 0.6 → p = 0.8 → T(8) = 10 (0.2 + 0.1)
    assert lat is not None and lat.value == pytest.approx(3.0) and lat.pessimistic == pytest.approx(lat.high)


def test_noise_in_the_rounds_widens_the_interval_around_the_central_projection():
    c = curve({1: [95.0, 100.0, 105.0, 99.0, 101.0], 2: [170.0, 190.0, 180.0, 185.0, 175.0]})
    tp = project_throughput(c, 8)
    assert tp is not None and tp.low < tp.value < tp.high
    assert tp.pessimistic == tp.low  # a throughput bound is met at the interval's low end
    quiet = project_throughput(curve({1: [100.0] * 5, 2: [180.0] * 5}), 8)
    assert quiet is not None and (tp.high - tp.low) > (quiet.high - quiet.low)


def test_a_measured_core_count_is_not_projected():
    tp = project_throughput(curve({1: [100.0, 101.0], 2: [190.0, 192.0]}), 2)
    assert tp is not None and tp.measured and tp.value == pytest.approx(191.0) and "measured at 2 vCPUs" in tp.note


def test_served_capacity_scales_with_the_fitted_ratio():
    c = curve({1: [100.0] * 3, 2: [200.0] * 3})  # linear
    tp = project_throughput(c, 8, served=Served((150.0,), 2))
    assert tp is not None and tp.basis == "served" and tp.value == pytest.approx(600.0) and not tp.measured


def test_one_core_is_not_projected():
    c = curve({1: [100.0, 101.0]})
    assert project_throughput(c, 8) is None and project_latency(c, 8) is None
    assert "fewer than two points" in (why_not(c) or "")
    assert "not measured" in (why_not(None) or "")


def test_band_brackets_the_fit():
    cores, fit, lo, hi = band(curve({1: [95.0, 100.0, 105.0], 2: [170.0, 190.0, 180.0]}), 8)
    assert cores == list(range(1, 9)) and all(a <= f <= b for a, f, b in zip(lo, fit, hi, strict=True))


@pytest.mark.isa
def test_the_scaling_job_measures_every_core_count_in_rounds(tmp_path):
    """Real sessions opened as the server opens them, on a tiny ONNX classifier: one point per core, every round's
    figure kept (a projection's interval is drawn from them), a variant that cannot open recorded with why."""
    import numpy as np

    from conftest import tiny_classifier_onnx
    from servopt.bench.jobs import OpenSpec
    from servopt.bench.scaling import ScalingJob, machine_cores
    from servopt.contracts import Artifact
    from servopt.data.dataset import Dataset

    model = tiny_classifier_onnx(tmp_path / "m.onnx", ["a", "b", "c"])
    Dataset({"input": np.random.default_rng(0).standard_normal((40, 3, 32, 32)).astype(np.float32)}, None, None, "t").save(
        tmp_path / "d.npz")
    good = OpenSpec(name="ort", artifact=Artifact(format="onnx", path=str(model)), runtime="onnxruntime")
    bad = OpenSpec(name="broken", artifact=Artifact(format="onnx", path=str(tmp_path / "missing.onnx")), runtime="onnxruntime")
    result = ScalingJob(sessions=[good, bad], data=str(tmp_path / "d.npz"), batch_size=8, rounds=2, seconds=0.05).run(0.0)
    curve = result.curves["ort"]
    assert [p.cores for p in curve.points] == list(range(1, machine_cores() + 1))
    assert all(len(p.throughput_ips) == 2 and len(p.p50_ms) == 2 and min(p.throughput_ips) > 0 for p in curve.points)
    assert result.curves["broken"].error and not result.curves["broken"].points


# ---------------------------------------------------------------------------------------------- the verdict and the price
def _decision_inputs(tp_rounds: dict[int, list[float]], p50_rounds: dict[int, list[float]]):
    from servopt.contracts import Scaling
    from test_racing import HERE, IMAGES, rec

    ref = rec("ort-fp32", 6.0, 200)
    pick = rec("int8", 2.0, 420)  # this machine: 420/s on 2 cores, far under the instance's bound of 1000
    scaling = Scaling(curves={"int8": curve(tp_rounds, p50_rounds).model_copy(update={"variant": "int8"}),
                              "ort-fp32": curve({1: [100.0] * 3, 2: [200.0] * 3}).model_copy(update={"variant": "ort-fp32"})},
                      rounds=3, environment=HERE)
    return ref, pick, scaling, IMAGES


def _target(**kw):
    from servopt.optimize.targets import Target

    kw = {"threads_per_core": 1, **kw}  # 8 cores: the law across cores alone (SMT has tests of its own)
    return Target(name="srv", hardware="8-vCPU server", device="cpu", objective="throughput", min_throughput_ips=1000,
                  max_p50_ms=3.0, instance_vcpus=8, price_per_hour=0.5, **kw)


def test_a_bound_only_the_projection_meets_passes_and_says_projected():
    from servopt.optimize import pricing
    from servopt.optimize.decide import decide

    ref, pick, scaling, family = _decision_inputs({1: [215.0, 210.0, 212.0], 2: [420.0, 418.0, 421.0]},
                                                  {1: [4.0] * 3, 2: [2.2] * 3})
    target = _target()
    without = decide(target, [ref, pick], ref, family)  # no projection: this machine's figures judge nothing of the instance
    assert all(b.status == "not measured" for b in without.verdict.bounds if b.kind == "speed")
    assert "not projected to the instance's 8 vCPUs" in without.verdict.bounds[-1].note
    d = decide(target, [ref, pick], ref, family, scaling=scaling)
    assert d.status == "pass" and d.recommended == "int8" and d.projected == "projected from 2 cores to 8 vCPUs"
    tp = next(b for b in d.verdict.bounds if b.bound == "throughput_ips")
    assert tp.projection is not None and tp.value == tp.projection.low and tp.value >= 1000
    priced = pricing.priced(d, [ref, pick], load_ips=5000)
    price = priced.verdict.price
    assert price.capacity_ips == tp.projection.low == tp.value, "priced where the verdict was judged: the band's low end"
    assert price.capacity_central_ips == tp.projection.value and price.projected and price.basis == "offline"
    assert price.per_million_usd == price.per_million_range_usd[1] > price.per_million_central_usd
    assert price.instances == __import__("math").ceil(5000 / tp.projection.low), "provisioned at the pessimistic end"


def test_a_variant_not_projected_is_not_picked_over_those_the_projection_judged():
    """The original is never a scaling candidate: with the others projected to the instance and failing, it used to
    "pass" with its speed bounds unjudged, and a 5-minute demo with a busy process on each core recommended PyTorch
    eager (72 ms a request) for cpu-server's 3 ms and served it. Now the projected ones decide; with none projected
    the decision is undecided, as before."""
    from servopt.optimize.decide import decide
    from test_racing import rec

    ref, pick, scaling, family = _decision_inputs({1: [215.0] * 3, 2: [420.0] * 3}, {1: [4.0] * 3, 2: [2.2] * 3})
    eager = rec("torch-eager", 72.0, 40)
    target = _target().model_copy(update={"min_throughput_ips": 100000})  # nothing projected meets it
    d = decide(target, [ref, pick, eager], ref, family, scaling=scaling)
    assert d.recommended is None and d.status == "fail" and d.nearest in ("int8", "ort-fp32"), d.reason
    assert d.nearest != "torch-eager"
    none = decide(target, [ref, pick, eager], ref, family)  # nothing projected: nothing judged the instance's bounds
    assert none.status == "undecided (not projected)"


def test_a_bound_met_only_by_the_central_projection_fails():
    from servopt.optimize.decide import decide

    # noisy rounds: the central projection is over 1000/s on 8 vCPUs, the interval's low end under it
    ref, pick, scaling, family = _decision_inputs({1: [140.0, 215.0, 270.0, 210.0, 212.0], 2: [300.0, 420.0, 520.0, 418.0, 421.0]},
                                                  {1: [4.0] * 3, 2: [2.2] * 3})
    d = decide(_target(), [ref, pick], ref, family, scaling=scaling)
    tp = next(b for b in d.verdict.bounds if b.bound == "throughput_ips")
    assert tp.projection.value >= 1000 > tp.projection.low
    assert tp.status == "fail" and d.status == "fail" and "projected" in d.shortfall


def test_the_verdict_and_the_price_quote_the_same_served_capacity():
    from servopt.contracts import Capacity, ServeConfig
    from servopt.optimize import pricing
    from servopt.optimize.decide import decide

    ref, pick, scaling, family = _decision_inputs({1: [215.0] * 3, 2: [420.0] * 3}, {1: [4.0] * 3, 2: [2.2] * 3})
    capacity = Capacity(variant="int8", slo="p99 <= 50 ms", capacity_rps=250.0, cores=2, confirmed=True,
                        config=ServeConfig(instances=2, threads=1, max_batch=32, max_delay_us=2000))
    d = pricing.priced(decide(_target(), [ref, pick], ref, family, scaling=scaling, capacity=capacity), [ref, pick], None)
    tp = next(b for b in d.verdict.bounds if b.bound == "throughput_ips")
    # served 250/s on 2 cores, scaled by the fitted curve's X(8)/X(2): about 880/s, short of 1000
    assert tp.projection.basis == "served" and d.verdict.price.capacity_ips == tp.projection.low == tp.value
    assert tp.status == "fail" and d.capacity == capacity and "served capacity" in d.shortfall


def test_serve_target_uses_the_configuration_found_scaled_to_the_machine():
    from servopt.contracts import Capacity, ServeConfig
    from servopt.serve.model import capacity_settings

    cap = Capacity(variant="v", slo="p99 <= 50 ms", capacity_rps=100.0, cores=2,
                   config=ServeConfig(instances=2, threads=1, max_batch=16, max_delay_us=500))
    assert capacity_settings(cap, 8) == {"instances": 8, "threads": 1, "max_batch": 16, "max_delay_us": 500}
    assert capacity_settings(cap, 2)["instances"] == 2 and capacity_settings(cap, 1)["instances"] == 1


def test_core_counts_stay_few_on_a_large_node():
    from servopt.bench.scaling import core_counts

    assert core_counts(1) == [1] and core_counts(2) == [1, 2] and core_counts(8) == [1, 2, 3, 4, 8]
    assert core_counts(64) == [1, 2, 3, 4, 8, 16, 32, 64] and core_counts(6) == [1, 2, 3, 4, 6]


def test_rounds_taken_while_others_used_the_machine_are_said():
    c = curve({1: [100.0] * 3, 2: [120.0] * 3})
    quiet = project_throughput(c, 8)
    assert quiet is not None and "noisy" not in quiet.note
    loud = c.model_copy(update={"points": [p.model_copy(update={"other_share": [0.02, 0.45, 0.03]}) for p in c.points]})
    tp = project_throughput(loud, 8)
    assert tp is not None and "noisy: other processes used up to 45% of the machine in 2 of 6 rounds" in tp.note


def test_a_model_whose_weights_overflow_without_vnni_fails_a_target_without_it():
    """Built on a VNNI machine with 8-bit weights, a dynamic INT8 model computes wrong sums on an AVX2 target (U8S8
    pairs saturate in int16): the target's ISA bound fails, naming why; a VNNI target is not concerned."""
    from servopt.contracts import Artifact
    from servopt.optimize.decide import judge
    from servopt.optimize.targets import PRESETS
    from test_racing import IMAGES, rec

    ref = rec("ort-fp32", 6.0, 200)
    risky = rec("int8", 2.0, 420).model_copy(update={"artifact": Artifact(
        format="onnx", path="m.onnx", report={"u8s8_overflowing_pairs": 419091, "safe_without_vnni": False})})
    safe = risky.model_copy(update={"artifact": risky.artifact.model_copy(update={"report": {"safe_without_vnni": True}})})
    avx2 = PRESETS["cpu-server"]
    bound = next(b for b in judge(avx2, risky, ref, IMAGES).bounds if b.bound == "runs_on_target_isa")
    assert bound.status == "fail" and "419091 weight pairs" in bound.note
    assert not any(b.bound == "runs_on_target_isa" for b in judge(avx2, safe, ref, IMAGES).bounds)
    x64 = risky.model_copy(update={"options": {"x64_quant_precision": True}})  # U8U8 kernels: ORT sums no int16 pairs
    assert not any(b.bound == "runs_on_target_isa" for b in judge(avx2, x64, ref, IMAGES).bounds)
    vnni = avx2.model_copy(update={"isa": "avx512_vnni"})
    assert not any(b.bound == "runs_on_target_isa" for b in judge(vnni, risky, ref, IMAGES).bounds)


def test_each_variant_is_judged_on_its_own_served_capacity():
    """A served capacity that moves the pick gets the new pick served too (Sweep.run_capacity); decide judges each
    variant on its own capacity and the rest on their offline projection."""
    from servopt.contracts import Capacity, Scaling
    from servopt.optimize.decide import decide
    from test_racing import HERE, IMAGES, rec

    ref = rec("ort-fp32", 6.0, 200)
    a, b = rec("int8-a", 2.0, 600), rec("int8-b", 2.0, 590)
    both = {1: [300.0] * 3, 2: [600.0] * 3}
    curves = {n: curve(both).model_copy(update={"variant": n}) for n in ("int8-a", "int8-b")}
    curves["ort-fp32"] = curve({1: [100.0] * 3, 2: [150.0] * 3}).model_copy(update={"variant": "ort-fp32"})  # 240/s on 8
    scaling = Scaling(curves=curves, rounds=3, environment=HERE)
    served_a = Capacity(variant="int8-a", slo="p99 <= 50 ms", capacity_rps=200.0, cores=2, confirmed=True)
    first = decide(_target(), [ref, a, b], ref, IMAGES, scaling=scaling, capacity=[served_a])
    # a missed on its served 200/s (800 on 8 vCPUs); b, not served, passed on its offline 2,400/s before: judged at the
    # share a kept served (a third of 600/s), it misses like a — like with like, not an offline figure beside a served one
    vb = next(v for v in first.verdicts if v.variant == "int8-b")
    tb = next(x for x in vb.bounds if x.bound == "throughput_ips")
    assert tb.projection.basis == "estimated" and tb.projection.value == pytest.approx(800.0) and tb.status == "fail"
    assert first.status == "fail" and "int8-a kept served" in tb.projection.note
    faster = {**curves, "int8-b": curve({1: [900.0] * 3, 2: [1800.0] * 3}).model_copy(update={"variant": "int8-b"})}
    moved = decide(_target(), [ref, a, b], ref, IMAGES, scaling=scaling.model_copy(update={"curves": faster}),
                   capacity=[served_a])
    assert moved.recommended == "int8-b"  # three times a's offline figure: it passes even at a's share (2,400/s), so it is served next
    served_b = served_a.model_copy(update={"variant": "int8-b", "capacity_rps": 210.0})
    second = decide(_target(), [ref, a, b], ref, IMAGES, scaling=scaling, capacity=[served_a, served_b])
    assert second.status == "fail" and second.nearest in ("int8-a", "int8-b")  # both served, both short: tied, simplest
    assert second.capacity == {"int8-a": served_a, "int8-b": served_b}[second.nearest]
    nothing = served_a.model_copy(update={"capacity_rps": 0.0, "confirmed": False})
    zero = decide(_target(), [ref, a], ref, IMAGES, scaling=scaling, capacity=[nothing])
    tp = next(x for x in zero.verdict.bounds if x.bound == "throughput_ips")
    assert tp.projection.basis == "served" and tp.value == 0 and tp.status == "fail", "nothing met the SLO: nothing served"


def test_a_capacity_of_nothing_is_not_priced():
    """A pick that met the SLO at no rate tried (a loaded CI machine's quick run) fails its bound and has no price,
    never a division by zero."""
    from servopt.contracts import Capacity, Scaling
    from servopt.optimize import pricing
    from servopt.optimize.decide import decide
    from test_racing import HERE, IMAGES, rec

    ref, a = rec("ort-fp32", 6.0, 200), rec("int8-a", 2.0, 600)
    scaling = Scaling(curves={n: curve({1: [300.0] * 3, 2: [600.0] * 3}).model_copy(update={"variant": n})
                              for n in ("int8-a", "ort-fp32")}, rounds=3, environment=HERE)
    nothing = Capacity(variant="int8-a", slo="p99 <= 50 ms", capacity_rps=0.0, cores=2)
    d = pricing.priced(decide(_target(), [ref, a], ref, IMAGES, scaling=scaling, capacity=[nothing]), [ref, a], 1000)
    v = next(v for v in d.verdicts if v.variant == "int8-a")
    assert v.price is None and not v.passes


def test_a_pick_moved_past_the_served_ones_is_said_to_be_judged_offline():
    """Each served capacity moved the pick (served figures include HTTP and batching, offline ones do not): after
    ``racing.CAPACITY_PICKS`` served picks the last one is judged on its offline figures, and the run says so (the
    image demo served two ORT INT8 picks and ended on an OpenVINO one, unserved and unsaid)."""
    from types import SimpleNamespace

    from servopt.contracts import Capacity, Record
    from servopt.optimize import racing
    from servopt.optimize.instance import SweepInstance
    from servopt.optimize.targets import PRESETS

    target = PRESETS["cpu-server"]
    names = ["a", "b", "c", "d"][: racing.CAPACITY_PICKS + 1]
    records = [Record(name=n, runtime="onnxruntime", status="ok", artifact={"format": "onnx", "path": f"/{n}.onnx"}) for n in names]

    def decided(t, found):  # every served pick misses: the next one passes on its offline figures
        return SimpleNamespace(recommended=names[len(found)], nearest=None, pick=names[len(found)])

    sweep = SimpleNamespace(problems=[], capacity_probe=object(), instance_targets=lambda ts: ts,
                            _capacity_of=lambda t, rec, kind: Capacity(variant=rec.name, slo="p99 <= 50 ms", capacity_rps=10.0))
    out = SweepInstance.run_capacity(sweep, [target], decided, records, None)
    assert [c.variant for c in out[target.name]] == names[:-1]
    assert any(p.startswith(f"{target.name}: {names[-1]} became the pick") and "offline figures" in p for p in sweep.problems)


def test_a_capacity_search_that_ran_out_of_time_is_kept_for_reading_and_searched_again(tmp_path):
    """A search the budget cut short is no capacity, so a rerun with more time searches again; but its steps are what
    says why it ran out (the image demo's pick ran out of its 60 s and left nothing to read), so they are kept."""
    import json
    from types import SimpleNamespace

    from servopt.contracts import Capacity, LoadStep, Record
    from servopt.optimize.instance import SweepInstance
    from servopt.optimize.targets import PRESETS

    target = PRESETS["cpu-server"]
    rec = Record(name="a", runtime="onnxruntime", status="ok", artifact={"format": "onnx", "path": "/a.onnx"})
    step = LoadStep(rate_rps=200.0, achieved_rps=190.0, requests=300, duration_s=1.5, p50_ms=14.6, p99_ms=65.0, errors=0,
                    meets=False, valid=True)
    calls = []

    def submit(fn, *args, **kw):
        calls.append(args)
        return SimpleNamespace(result=lambda: Capacity(variant="a", slo="p99 <= 50 ms", capacity_rps=0.0, steps=[step],
                                                       timed_out=True))

    sweep = SimpleNamespace(problems=[], settings=SimpleNamespace(quick=False, budget="5m"), budget=no_budget(60 + 14, elapsed=0),
                            dir=SimpleNamespace(capacity=lambda t, v: tmp_path / f"{t}-{v}.json"), out=tmp_path,
                            progress=SimpleNamespace(step=lambda m: None), executor=SimpleNamespace(submit=submit),
                            kinds={}, _for=lambda kind: "", capacity_probe=object(), served_data=lambda t: None)
    assert SweepInstance._capacity_of(sweep, target, rec, None) is None
    kept = json.loads((tmp_path / "cpu-server-a.json").read_text())
    assert kept["cache_key"] is None and kept["capacity"]["steps"][0]["p50_ms"] == 14.6
    assert SweepInstance._capacity_of(sweep, target, rec, None) is None and len(calls) == 2, "searched again"
    assert "ran out of the time the budget left it" in sweep.problems[0]
