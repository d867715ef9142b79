"""bench/duel.py: settling a tie block by block — the statistic, its error rates, a real duel, and the decision."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from servopt.bench import duel
from servopt.bench.jobs import DuelJob
from servopt.contracts import Duel, Interleaved
from servopt.families import FAMILIES
from servopt.optimize.candidates import unsettled
from servopt.optimize.decide import decide
from servopt.optimize.targets import Target
from test_racing import _int8, _rounds, rec

IMAGES = FAMILIES.get("image-classification")
Z, GAP, MIN = DuelJob.model_fields["z"].default, 0.03, DuelJob.model_fields["min_pairs"].default


@pytest.mark.parametrize(("logs", "said"), [
    ([math.log(0.8)] * 20, "a"),                      # a 25 % ahead in every pair
    ([math.log(1.25)] * 20, "b"),
    ([math.log(0.99), math.log(1.01)] * 10, "tie"),   # within 3 % either way
    ([math.log(0.985)] * 20, "tie"),                  # surely ahead, but by 1.5 %: not worth a recipe
    ([math.log(0.8), math.log(1.25)] * 10, "undecided"),
    ([math.log(0.8)] * (MIN - 1), "undecided"),        # too few pairs to say anything
])
def test_the_verdict_of_a_duel(logs, said):
    assert duel.verdict(logs, GAP, Z, MIN)[0] == said


def _simulated(gap: float, sd: float, pairs: int, rng: np.random.Generator) -> str:
    """One duel as ``run_duel`` takes it (a look every few pairs, stopping when settled), on pairs whose log ratio is
    normal around a's lead of ``gap``."""
    logs: list[float] = []
    for _ in range(pairs):
        logs.append(-math.log1p(gap) + sd * rng.standard_normal())
        if duel.settled([logs], GAP, Z, MIN):
            break
    return duel.verdict(logs, GAP, Z, MIN)[0]


def test_a_duel_of_equals_rarely_names_a_winner_and_a_real_lead_is_found():
    """The figures of this machine (2026-11-27, AMD EPYC AVX2): a pair's p50 ratio spread about 0.2 (log) between
    two text encoders; their 20 % gap was found in 15-60 pairs. Looking every few pairs must not turn noise into a
    winner: with 60 pairs of equals, fewer than 1 % of duels name one (seeded: the same draws every run)."""
    rng = np.random.default_rng(7)
    equals = [_simulated(0.0, 0.2, 60, rng) for _ in range(1000)]
    assert sum(s in ("a", "b") for s in equals) < 10
    found = [_simulated(0.2, 0.2, 60, rng) for _ in range(500)]
    assert sum(s == "a" for s in found) >= 475
    assert all(s != "b" for s in found)


@pytest.mark.slow
def test_a_real_duel_finds_the_faster_model_on_both_figures(tmp_path):
    """Two ONNX models on the same inputs, one a pooling, one four convolutions before it: in one process, block by
    block, the duel names the pooling model ahead on p50 and on batch throughput."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from conftest import channel_mean_onnx
    from servopt.bench.jobs import OpenSpec
    from servopt.bench.launcher import launch
    from servopt.contracts import Artifact
    from servopt.data.dataset import Dataset

    channel_mean_onnx(tmp_path / "fast.onnx", size=32)
    rng = np.random.default_rng(0)
    inits, nodes, x = [], [], "input"
    for i, (cin, cout) in enumerate([(3, 32), (32, 32), (32, 32), (32, 3)]):
        inits.append(numpy_helper.from_array((rng.standard_normal((cout, cin, 3, 3)) * 0.1).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
        x = f"c{i}"
    nodes += [helper.make_node("GlobalAveragePool", [x], ["pooled"]), helper.make_node("Flatten", ["pooled"], ["logits"])]
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 32, 32])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "slow.onnx"))
    x = rng.standard_normal((16, 3, 32, 32)).astype(np.float32)
    Dataset({"input": x}, x.mean(axis=(2, 3)).argmax(1), ["r", "g", "b"], "t").save(tmp_path / "d.npz")

    def spec(name: str) -> OpenSpec:
        return OpenSpec(name=name, artifact=Artifact(format="onnx", path=str(tmp_path / f"{name}.onnx")), runtime="onnxruntime",
                        options={"intra_op_threads": 1})

    # the sweep's time per figure: enough pairs on a loaded 2-core machine (it stops once both are settled)
    job = DuelJob(sessions=[spec("fast"), spec("slow")], data=str(tmp_path / "d.npz"), batch_size=8, seconds=8.0)
    launched = launch(job, tmp_path / "job")
    assert launched.result is not None, launched.error
    got = {d.what: d for d in launched.result.duels}
    assert set(got) == {"p50_ms", "throughput_ips"}
    for d in got.values():
        assert (d.a, d.b) == ("fast", "slow") and d.verdict == "a" and d.pairs >= MIN, d
        assert d.time_ratio < 0.5 and d.time_ratio_interval[1] < 1
    assert [p.name for p in launched.result.phases] == ["duel:p50_ms", "duel:throughput_ips"]


class _Clock:
    """A fake clock for ``bench.duel``: sessions advance it by what their calls cost."""

    def __init__(self) -> None:
        self.ns, self.last, self.switched = 0, None, 0

    def perf_counter_ns(self) -> int:
        return self.ns

    def perf_counter(self) -> float:
        return self.ns / 1e9

    def time(self) -> float:
        return self.ns / 1e9


class _Switching:
    """Two equally fast models (1 ms a call) in one process. For ``disturbed_ms`` after the other model's turn, this
    one's calls take ``slow``x as long: the other session's threads still spinning on one of the two cores, its weights
    in the caches. Served alone and warm, both take 1 ms."""

    def __init__(self, name: str, clock: _Clock, slow: float, disturbed_ms: float = 25.0) -> None:
        self.name, self.clock, self.slow, self.disturbed_ns = name, clock, slow, disturbed_ms * 1e6

    def prepare(self, x):
        return x

    def run_prepared(self, x) -> None:
        c = self.clock
        if c.last != self.name:
            c.last, c.switched = self.name, c.ns
        c.ns += int(1e6 * (self.slow if c.ns - c.switched < self.disturbed_ns else 1.0))


class _Data:
    def __len__(self) -> int:
        return 32

    def slice(self, a: int, b: int) -> int:
        return a

    def batch(self, n: int, offset: int = 0) -> int:
        return offset


def _switching_duel(monkeypatch, **kw) -> Duel:
    clock = _Clock()
    monkeypatch.setattr(duel, "time", clock)
    sessions = {"fp32": _Switching("fp32", clock, slow=1.5), "int8": _Switching("int8", clock, slow=1.0)}
    return duel.take_turns(sessions, _Data(), 32, ["p50_ms"], 20.0, GAP, Z, MIN, **kw)[0][0]


def test_the_calls_after_a_switch_are_run_but_not_counted(monkeypatch):
    """Z2 image demo: a duel of 40 ms blocks put INT8 9 % ahead of fp32 where separate processes found them equal.
    A block now starts with calls that are not counted (the other model's threads and weights gone), then counts
    long enough for a median of warm calls: two equal models are found equal, where the old blocks named a winner."""
    assert duel.block_calls("p50_ms", 5e6) == (20, 6) and duel.block_calls("throughput_ips", 150e6) == (2, 1)
    d = _switching_duel(monkeypatch)
    assert d.verdict == "tie" and d.time_ratio == pytest.approx(1.0), d
    old = _switching_duel(monkeypatch, block_seconds={"p50_ms": 0.04}, warm_seconds={"p50_ms": 0.0})
    # every other block of a model follows its own (the order turns round each cycle): half the pairs disturbed
    assert old.verdict != "tie" and old.time_ratio_interval[1] > 1.3, f"40 ms blocks counting every call: {old}"


def test_a_duel_opens_its_sessions_as_a_server_does(tmp_path):
    """ONNX Runtime's idle threads spin unless told not to, and the server tells them not to
    (``OnnxRuntime.serving_options``): a duel's sessions are opened the same way, so one model's spinning threads do not
    slow the other's block."""
    from conftest import channel_mean_onnx
    from servopt.bench.jobs import OpenSpec
    from servopt.contracts import Artifact
    from servopt.optimize.sweep import as_served, duel_job

    channel_mean_onnx(tmp_path / "m.onnx")
    artifact = Artifact(format="onnx", path=str(tmp_path / "m.onnx"))
    spec = OpenSpec(name="m", artifact=artifact, runtime="onnxruntime", options={"intra_op_threads": 2})
    assert spec.open().options.allow_spinning is True, "measured as the sweep measures: spinning"
    by_name = {"m": _int8("m", 300, ["ort-quantize-static"]).model_copy(update={"artifact": artifact, "options": spec.options})}
    [served] = duel_job(["m"], by_name, tmp_path / "d.npz", ["p50_ms"], 1.0).sessions
    assert served.options == {"intra_op_threads": 2, "allow_spinning": False}
    session = served.open()
    assert session.options.allow_spinning is False and session.info().details["intra_op_spinning"] == "off"
    bounded = spec.model_copy(update={"options": {"spin_duration_us": 50}})  # a spin the user bounded is served so
    assert as_served(bounded).options == {"spin_duration_us": 50}


# ---------------------------------------------------------------------------------------------------- the decision
STRICT = Target(name="cpu", hardware="h", device="cpu", objective="throughput", max_p50_ms=3, min_throughput_ips=1000)


def _race_1() -> tuple[list, Interleaved]:
    """Race 1 of the text benchmark on 2026-11-27 (AMD EPYC, AVX2): the fused INT8 encoder and the per-channel one, three
    interleaved rounds — 2.26/1.58/2.43 ms against 3.34/2.21/2.36 ms p50, 268/362/306 against 272/279/299 per second:
    a tie by the rounds (4.6 % and 9.7 % on the medians), and the simpler per-channel model was named."""
    ref = rec("ort-fp32", 6.0, 200)
    plain = _int8("ort-int8-dynamic-per-channel", 279, ["ort-quantize-dynamic"], p50=2.36)
    fused = _int8("ort-transformers-int8-dynamic", 306, ["ort-transformers-optimize", "ort-quantize-dynamic"], p50=2.26)

    il = Interleaved(reference="ort-fp32", rounds=3, order=[], variants={
        "ort-fp32": _rounds([195, 196, 126], [3.65, 4.6, 5.37]),
        "ort-int8-dynamic-per-channel": _rounds([272, 279, 299], [3.34, 2.21, 2.36]),
        "ort-transformers-int8-dynamic": _rounds([268, 362, 306], [2.26, 1.58, 2.43])})
    return [ref, plain, fused], il


def test_a_duel_settles_what_the_rounds_could_not():
    records, il = _race_1()
    ref = records[0]
    d = decide(STRICT, records, ref, IMAGES, il)
    assert d.nearest == "ort-int8-dynamic-per-channel" and len(d.tied) == 2, d.reason
    # what a sweep takes to a duel: the pick, its tied rival, then the baseline (within 1.6× of it on throughput), on
    # the target's two speed figures
    assert unsettled([STRICT], records, ref, IMAGES, il, rivals=2) == (
        ["ort-int8-dynamic-per-channel", "ort-transformers-int8-dynamic", "ort-fp32"], ["p50_ms", "throughput_ips"])
    assert unsettled([STRICT], records, ref, IMAGES, il, rivals=1)[0] == ["ort-int8-dynamic-per-channel", "ort-transformers-int8-dynamic"]
    # the duel of that run's artifacts (redecide.py --settle): fused 35 % ahead on p50, throughput undecided
    p50 = Duel(a="ort-int8-dynamic-per-channel", b="ort-transformers-int8-dynamic", what="p50_ms", pairs=15, time_ratio=1.350,
               time_ratio_interval=[1.042, 1.596], verdict="b")
    tp = Duel(a="ort-int8-dynamic-per-channel", b="ort-transformers-int8-dynamic", what="throughput_ips", pairs=18,
              time_ratio=1.039, time_ratio_interval=[0.778, 1.226], verdict="undecided")
    settled = il.model_copy(update={"duels": [p50, tp]})
    d = decide(STRICT, records, ref, IMAGES, settled)
    assert d.nearest == "ort-transformers-int8-dynamic" and d.tied == ["ort-transformers-int8-dynamic"], d.reason
    names, figures = unsettled([STRICT], records, ref, IMAGES, settled, rivals=1)  # the new pick's closest call: dueled
    assert all(settled.duel(f, a, b) for f in figures for i, a in enumerate(names) for b in names[i + 1:])
    # a duel that finds them equal leaves the tie to the simpler recipe, and the reason says how it was measured
    even = [p50.model_copy(update={"time_ratio": 1.01, "time_ratio_interval": [0.99, 1.02], "verdict": "tie"}), tp]
    edge = Target(name="edge", hardware="a76", device="edge", objective="latency", max_p50_ms=15)
    d = decide(edge, records, ref, IMAGES, il.model_copy(update={"duels": even}))
    assert d.recommended == "ort-int8-dynamic-per-channel", d.reason
    assert "block by block (15 pairs)" in d.reason and "within this machine's noise" in d.reason


def test_where_a_duel_and_the_rounds_disagree_one_decides_and_the_report_says_which():
    """Issue 40 (AVX2 Zen 3): the duel put the INT8 pick at 0.67x fp32's p50 where the rounds said 0.81x and separate
    processes 0.76-0.82x. A duel whose interval excludes the rounds' ratio does not decide a pair that does not run
    alike (INT8 against fp32): the rounds do — here a tie, so the simpler fp32 is picked — and the reason and the
    report's duel table say so. Two alike models (one precision, one size) keep the duel's verdict."""
    from servopt.optimize.decide import duel_decides
    from servopt.report.remeasure import duel_rows

    ref = rec("ort-fp32", 5.0, 200)
    int8 = _int8("ort-int8-static-qop-u8u8-rr", 205, ["ort-quantize-static"], p50=4.8)
    edge = Target(name="edge", hardware="a76", device="edge", objective="latency", max_p50_ms=15)
    il = Interleaved(reference="ort-fp32", rounds=3, order=[], variants={
        "ort-fp32": _rounds([200, 198, 202], [5.0, 5.1, 4.9]),
        "ort-int8-static-qop-u8u8-rr": _rounds([205, 204, 206], [4.8, 4.9, 4.75])})
    duel = Duel(a="ort-int8-static-qop-u8u8-rr", b="ort-fp32", what="p50_ms", pairs=40, time_ratio=0.80,
                time_ratio_interval=[0.78, 0.82], verdict="a")
    settled = il.model_copy(update={"duels": [duel]})
    assert abs(settled.duel_disagrees(duel) - 0.96) < 0.01 and not duel_decides(settled, duel, {r.name: r for r in (ref, int8)})
    d = decide(edge, [ref, int8], ref, IMAGES, settled)
    assert d.recommended == "ort-fp32" and set(d.tied) == {"ort-fp32", int8.name}, d.reason
    assert "the rounds decided" in d.reason and "0.800" in d.reason, d.reason
    (row,) = duel_rows(settled, [ref, int8])
    assert row.rounds == "0.961" and row.decided.startswith("the rounds"), row  # 4.8/5.0, 4.9/5.1, 4.75/4.9: 0.961 the median
    # the same duel between two alike INT8 models decides, though the rounds disagree
    twin = _int8("ort-int8-static-qop-u8s8-rr", 205, ["ort-quantize-static"], p50=5.0)
    alike = Interleaved(reference="ort-fp32", rounds=3, order=[], variants={
        "ort-fp32": il.variants["ort-fp32"], int8.name: il.variants[int8.name], twin.name: _rounds([200, 198, 202], [5.0, 5.1, 4.9])})
    duel2 = duel.model_copy(update={"b": twin.name})
    assert duel_decides(alike, duel2, {r.name: r for r in (ref, int8, twin)})
    assert decide(edge, [ref, int8, twin], ref, IMAGES, alike.model_copy(update={"duels": [duel2]})).recommended != twin.name


def test_a_close_call_between_two_runtimes_is_not_dueled():
    """Two runtimes' thread pools taking turns every 0.1 s in one process time each other's idle workers: a real
    EfficientNet-Lite0's ONNX Runtime fp32 and OpenVINO fp32 dueled 13-19 % apart on p50 in two runs, tied by the
    rounds (0.995-0.998) and by separate processes alternating (1.03×, interval 0.98-1.06). Only the pick's runtime's
    rivals take turns; the other's close call stays as the rounds left it."""
    records, il = _race_1()
    ref = records[0]
    other = [records[0], records[1], records[2].model_copy(update={"runtime": "openvino"})]
    names, _ = unsettled([STRICT], other, ref, IMAGES, il, rivals=2)
    assert "ort-transformers-int8-dynamic" not in names and names == ["ort-int8-dynamic-per-channel", "ort-fp32"]
    assert "ort-transformers-int8-dynamic" in unsettled([STRICT], records, ref, IMAGES, il, rivals=2)[0], "same runtime: dueled"


def test_a_lead_of_the_rounds_within_the_drift_goes_to_a_duel_too():
    """Race 2 of 2026-11-27's second image run (AMD EPYC, AVX2): U8S8 with 7-bit weights ahead of U8U8 on p50 in each
    of three rounds, 3.50 against 4.38 ms on the medians — a lead by the rounds' rule, so no tie. The same two, taking
    turns block by block on the full sweep's artifacts, were 0.6 % apart (interval -2.8 % to +2.6 %). A lead within
    this machine's drift between two moments goes to the duel like a tie; its verdict stands."""
    ref = rec("ort-fp32", 6.0, 200)
    u8s8 = _int8("ort-int8-static-qop-u8s8-rr", 296, ["ort-quantize-static"], "ort-int8-static-qop-u8s8", p50=3.5)
    u8u8 = _int8("ort-int8-static-qop-u8u8-rr", 283, ["ort-quantize-static"], p50=4.38)
    edge = Target(name="edge", hardware="a76", device="edge", objective="latency", max_size_mb=3, max_p50_ms=15)

    il = Interleaved(reference="ort-fp32", rounds=3, order=[], variants={
        "ort-fp32": _rounds([183, 200, 150], [4.91, 4.89, 6.36]),
        "ort-int8-static-qop-u8s8-rr": _rounds([297, 288, 296], [3.5, 3.62, 3.36]),
        "ort-int8-static-qop-u8u8-rr": _rounds([311, 283, 246], [4.12, 4.91, 4.38])})
    records = [ref, u8s8, u8u8]
    assert decide(edge, records, ref, IMAGES, il).recommended == "ort-int8-static-qop-u8s8-rr"  # the rounds' lead
    names, figures = unsettled([edge], records, ref, IMAGES, il, rivals=1)
    assert names == ["ort-int8-static-qop-u8s8-rr", "ort-int8-static-qop-u8u8-rr"] and figures == ["p50_ms"]
    even = Duel(a="ort-int8-static-qop-u8s8-rr", b="ort-int8-static-qop-u8u8-rr", what="p50_ms", pairs=50, time_ratio=0.994,
                time_ratio_interval=[0.974, 1.028], verdict="tie")
    d = decide(edge, records, ref, IMAGES, il.model_copy(update={"duels": [even]}))
    assert d.recommended == "ort-int8-static-qop-u8u8-rr" and set(d.tied) == {u8s8.name, u8u8.name}, d.reason
    # beyond the drift (a variant 2× slower on every figure the target uses) there is nothing to settle
    slow = il.model_copy(update={"variants": {**il.variants, "ort-int8-static-qop-u8u8-rr": _rounds([140, 141, 142], [7.5, 7.6, 7.7])}})
    assert unsettled([edge], records, ref, IMAGES, slow, rivals=1) == ([], [])


def test_under_a_time_budget_a_duel_takes_only_what_is_left():
    """The finish reserves nothing for a duel (a 3-minute image race then measured no INT8 variant): a duel gets what
    the budget leaves after loading it, the picks' profiles and the report, split between its figures, and none below
    ``racing.DUEL_MIN_SECONDS`` a figure (the tie then goes to the simplest recipe, and the run says so)."""
    from conftest import no_budget
    from servopt.optimize import racing
    from servopt.optimize.budget import Budget

    def budget(seconds: float | None, elapsed: float, instance: float = 0.0) -> Budget:
        b = no_budget(seconds, ["cpu-server", "gpu-server", "edge"], elapsed)
        b.instance_reserve = lambda _n, capacity=True: instance  # the scaling and capacity search to come
        return b

    assert budget(None, 500).duel_seconds(2) == racing.DUEL_SECONDS_PER_FIGURE
    assert budget(300, 200).duel_seconds(2) == racing.DUEL_SECONDS_PER_FIGURE
    left = 300 - 268 - racing.DUEL_LOAD_SECONDS - racing.closing_seconds(3)
    assert budget(300, 268).duel_seconds(2) == pytest.approx(left / 2, abs=0.01) and left / 2 >= racing.DUEL_MIN_SECONDS
    assert budget(300, 285).duel_seconds(2) is None
    # the instance's answer (scaling, the capacity search) comes after the duel: its time is kept for it
    kept = (300 - 210 - racing.DUEL_LOAD_SECONDS - racing.closing_seconds(3) - 60) / 2
    assert kept < racing.DUEL_SECONDS_PER_FIGURE and budget(300, 210, instance=60.0).duel_seconds(2) == pytest.approx(kept, abs=0.01)


def test_a_duel_job_takes_its_variants_environment_and_a_new_duel_replaces_the_old_one():
    """The duel runs the variants as the interleaved rounds do (a torch variant's allocator settings travel with the
    process); a later duel of the same pair and figure, either way round, replaces the earlier one, and ``covers``
    says when every pair has had its duel."""
    from servopt.contracts import Artifact
    from servopt.optimize.sweep import duel_job

    by_name = {n: _int8(n, 300, ["ort-quantize-static"]).model_copy(update={
        "artifact": Artifact(format="onnx", path=f"/m/{n}.onnx"), "env": env}) for n, env in
        [("x", {"MALLOC_CONF": "background_thread:true"}), ("y", {}), ("z", {})]}
    job = duel_job(["x", "y"], by_name, Path("/d.npz"), ["p50_ms"], 3.0)
    assert [s.name for s in job.sessions] == ["x", "y"] and job.env == {"MALLOC_CONF": "background_thread:true"}
    assert job.figures == ["p50_ms"] and job.seconds == 3.0 and job.tie_gap == GAP

    def d(a: str, b: str, what: str, said: str) -> Duel:
        return Duel(a=a, b=b, what=what, pairs=10, time_ratio=1.0, time_ratio_interval=[0.9, 1.1], verdict=said)

    il = Interleaved(reference="x", rounds=3, order=[], variants={}).with_duels([d("x", "y", "p50_ms", "undecided"), d("x", "z", "p50_ms", "tie")])
    again = il.with_duels([d("y", "x", "p50_ms", "a")])
    assert len(again.duels) == 2 and again.duel("p50_ms", "x", "y").verdict == "a"
    assert again.covers(["x", "y", "z"], ["p50_ms"]) is False  # y and z never met
    assert again.covers(["x", "y"], ["p50_ms"]) and not again.covers(["x", "y"], ["p50_ms", "throughput_ips"])


def test_a_resumed_run_duels_no_more_than_the_first_did(tmp_path, monkeypatch):
    """``settle_ties`` runs at most ``racing.DUEL_SETTLE_ROUNDS`` duel jobs, and stores how many with the rounds: a
    resumed run whose last duel left the new pick with a close call (each duel moving the pick) measures nothing
    more, where it used to run one more duel (a CI flake of test_resume_measures_nothing_again)."""
    from types import SimpleNamespace

    from servopt.contracts import Duels
    from servopt.optimize import racing, remeasure
    from servopt.optimize.sweep import Sweep, _stored_interleaved
    from servopt.results import write_json_atomic

    path = tmp_path / "interleave.json"
    write_json_atomic(path, Interleaved(reference="r", rounds=3, order=[], variants={}))
    pairs = iter([["a", "b"], ["b", "c"], ["c", "d"], ["d", "e"]])  # every duel leaves another close call
    monkeypatch.setattr(remeasure, "unsettled", lambda *a, **k: (next(pairs), ["p50_ms"]))
    monkeypatch.setattr(remeasure, "duel_job", lambda names, *a, **k: names)
    jobs: list[list[str]] = []

    def result(self, names, *a):
        jobs.append(names)
        return Duels(duels=[Duel(a=names[0], b=names[1], what="p50_ms", pairs=9, time_ratio=1.2,
                                 time_ratio_interval=[1.1, 1.3], verdict="b")], seconds=1.0)

    fake = SimpleNamespace(dir=SimpleNamespace(interleave=lambda kind: path, eval_data=tmp_path / "d.npz", work_root=tmp_path,
                                               work=lambda name, kind=None: tmp_path / name),
                           budget=SimpleNamespace(duel_seconds=lambda n: 1.0), settings=SimpleNamespace(quick=True), problems=[],
                           interleave_protocol=SimpleNamespace(batch_size=8), family=None,
                           progress=SimpleNamespace(step=lambda s: None))
    fake._result_or_problem = lambda *a: result(fake, *a)
    first = Sweep.settle_ties(fake, [], [], None, _stored_interleaved(path), None)
    assert len(jobs) == racing.DUEL_SETTLE_ROUNDS and first.settle_rounds == racing.DUEL_SETTLE_ROUNDS
    stored = _stored_interleaved(path)
    assert stored.settle_rounds == racing.DUEL_SETTLE_ROUNDS and len(stored.duels) == racing.DUEL_SETTLE_ROUNDS
    again = Sweep.settle_ties(fake, [], [], None, stored, None)
    assert len(jobs) == racing.DUEL_SETTLE_ROUNDS and again.duels == stored.duels  # the resume measured nothing
