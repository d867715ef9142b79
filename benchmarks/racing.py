"""Racing sweep vs full sweep: wall time to an answer, and whether the picks agree (issue 18).

    PYTHONPATH=src python benchmarks/racing.py --races 3              # the image demo
    PYTHONPATH=src python benchmarks/racing.py --text --races 3       # the sentence-encoder demo
    PYTHONPATH=src python benchmarks/racing.py --races 1 --budget 3m  # + a budgeted run: is the budget honoured?
    PYTHONPATH=src python benchmarks/racing.py --full-from runs/racing/racing.json  # races against an earlier full sweep

Each run is `servopt demo` in a fresh folder and its own process, one after another: the full sweep (`--full`), the
races (the demo's default `--budget 5m`), the budgeted run; the demo's model is prepared once, untimed. A race agrees
with the full sweep on a target when it picks the same variant, or one at most 3 % behind the full sweep's pick on the
target's objective in a 20 s duel of the two builds (``bench.duel``: blocks taking turns in one process, the median of
per-pair ratios with its interval). The gap in the full sweep's own records, which mix moments of a shared machine, is
printed beside it (docs/benchmarks.md says why it is no judge). Writes ``racing.json`` with the CPU and its flags.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servopt.bench.launcher import launch
from servopt.machine import cpu_features, cpu_model
from servopt.optimize.noise import duel_lead
from servopt.optimize.rundir import RunDir, load_run
from servopt.optimize.sweep import duel_job
from servopt.settings import parse_duration

TOLERANCE = 0.03
DUEL_SECONDS = 20.0


def run_demo(out: Path, text: bool, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "servopt", "demo", "--out", str(out), "--quiet", *(["--text"] if text else []), *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    summary, records = load_run(out)
    picks = {d.target.name: d.pick for d in summary.targets}
    return {"out": str(out), "wall_s": round(wall, 1), "picks": picks, "screened_out": sum(bool(r.screened_out) for r in records),
            "not_tried": [v.name for v in summary.not_tried], "measured": sum(r.status == "ok" for r in records)}


def objective_figure(out: Path, target: str, variant: str | None) -> float | None:
    """The target's objective figure of ``variant`` in a run (interleaved where re-measured, else the sweep's)."""
    decision = next(d for d in load_run(out)[0].targets if d.target.name == target)
    f = next((v.figures for v in decision.verdicts if v.variant == variant), None)
    return None if f is None else f.throughput_ips if decision.target.objective == "throughput" else f.p50_ms


def side_by_side(full_out: Path, objective: str, theirs: str, mine: str) -> tuple[float, list[float]] | None:
    """How far ``mine`` is behind ``theirs`` on ``objective`` (0.05: 5 % behind; negative: ahead) and the interval of
    that, the two taking turns block by block in one process on the full run's artifacts; None when either cannot be
    opened."""
    _, records = load_run(full_out)
    by_name = {r.name: r for r in records if r.status == "ok" and r.artifact is not None}
    if theirs not in by_name or mine not in by_name:
        return None
    what = "throughput_ips" if objective == "throughput" else "p50_ms"
    job = duel_job([mine, theirs], by_name, RunDir(full_out).eval_data, [what], DUEL_SECONDS)
    launched = launch(job, full_out / "work" / f"agreement-{mine}-vs-{theirs}")
    if launched.result is None or not launched.result.duels:
        return None
    duel = launched.result.duels[0]  # a = mine: a time ratio above 1 is mine behind
    return -duel_lead(duel, mine), sorted(x - 1 for x in duel.time_ratio_interval)


def agreement(full: dict, race: dict) -> dict[str, str]:
    """Per target: 'same', or 'within 3 %' / 'differs' judged side by side (with the gap, and the gap in the full sweep's
    records, which mix moments)."""
    out, full_out = {}, Path(full["out"])
    objectives = {d.target.name: d.target.objective for d in load_run(full_out)[0].targets}
    for target, pick in full["picks"].items():
        mine = race["picks"].get(target)
        if mine == pick:
            out[target] = "same"
            continue
        theirs_fig = objective_figure(full_out, target, pick)
        mine_fig = objective_figure(full_out, target, mine)
        records_gap = f"{abs(mine_fig - theirs_fig) / theirs_fig:.1%}" if theirs_fig and mine_fig else "n/a"
        judged = side_by_side(full_out, objectives[target], pick, mine) if pick and mine else None
        if judged is None:
            out[target] = f"differs ({mine} vs {pick}; not comparable side by side; records {records_gap})"
            continue
        behind, (lo, hi) = judged
        verdict = "within 3 %" if behind <= TOLERANCE else "differs"
        where = f"{behind:.1%} behind" if behind > 0 else f"{-behind:.1%} ahead"
        out[target] = (f"{verdict} ({mine} vs {pick}: {where} block by block, interval {lo:+.1%} to {hi:+.1%}; "
                       f"{records_gap} apart in the full sweep's records)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", action="store_true", help="the sentence-encoder demo")
    ap.add_argument("--races", type=int, default=3)
    ap.add_argument("--budget", default=None, help="also one race with this --budget (e.g. 3m)")
    ap.add_argument("--no-full", action="store_true", help="skip the full sweep (races only)")
    ap.add_argument("--full-from", type=Path, default=None,
                    help="compare with the full sweep of an earlier racing.json (same machine, same model) instead of running one")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="servopt-racing-"))
    root.mkdir(parents=True, exist_ok=True)
    flags = cpu_features()
    print(f"CPU: {cpu_model()} — {flags.describe()} (flags: {' '.join(sorted(flags.flags))}); {os.cpu_count()} cores")
    # the one-time model preparation, untimed: a --variants run of the original only
    subprocess.run([sys.executable, "-m", "servopt", "demo", "--out", str(root / "prepare"), "--quiet", *(["--text"] if args.text else []),
                    "--variants", "ort-fp32"], check=True, capture_output=True)
    report: dict = {"cpu": cpu_model(), "flags": sorted(flags.flags), "text": args.text, "runs": {}}
    full = None
    if args.full_from:
        full = json.loads(args.full_from.read_text())["runs"]["full"]
        report["runs"]["full"] = {**full, "from": str(args.full_from)}
        print(f"full sweep (from {args.full_from}): {full['wall_s']:.0f} s; picks {full['picks']}")
    elif not args.no_full:
        full = run_demo(root / "full", args.text, ["--full"])
        report["runs"]["full"] = full
        print(f"full sweep: {full['wall_s']:.0f} s, {full['measured']} variants measured; picks {full['picks']}")
    for i in range(args.races):
        race = run_demo(root / f"race-{i}", args.text, [])
        if full:
            race["agreement"] = agreement(full, race)
            race["ratio_to_full"] = round(race["wall_s"] / full["wall_s"], 2)
        report["runs"][f"race-{i}"] = race
        print(f"race {i}: {race['wall_s']:.0f} s ({race.get('ratio_to_full', '—')}× the full sweep), screened out "
              f"{race['screened_out']}, not tried {len(race['not_tried'])}; picks {race['picks']}; {race.get('agreement', '')}")
    if args.budget:
        budgeted = run_demo(root / "budget", args.text, ["--budget", args.budget])
        budgeted["budget_s"] = parse_duration(args.budget)
        budgeted["within_10_percent"] = budgeted["wall_s"] <= 1.1 * budgeted["budget_s"]
        if full:
            budgeted["agreement"] = agreement(full, budgeted)
        report["runs"]["budget"] = budgeted
        print(f"budget {args.budget}: {budgeted['wall_s']:.0f} s (honoured within 10 %: {budgeted['within_10_percent']}), not tried "
              f"{budgeted['not_tried']}; {budgeted.get('agreement', '')}")
    (root / "racing.json").write_text(json.dumps(report, indent=1))
    print(f"written: {root / 'racing.json'}")


if __name__ == "__main__":
    main()
