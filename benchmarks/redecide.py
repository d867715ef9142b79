"""Decide a finished run's targets again with this checkout's `decide()`: nothing is measured.

    PYTHONPATH=src python benchmarks/redecide.py RUN_DIR [RUN_DIR ...] [--family text-embedding]
    PYTHONPATH=src python benchmarks/redecide.py RUN_DIR ... --settle   # + the duels a run of this checkout would take

The decision is a pure function of a run's records (`results.jsonl`) and its side-by-side figures
(`interleave.json`), so a change to the decision rule can be checked against every stored run — the racing benchmark's
full sweeps and races included — before spending the machine on new ones. Prints each target's pick (or nearest
miss) and the variants tied with it. (A run that also re-measured under an instruction-set cap decided those
targets on the capped figures; this uses the uncapped ones.)

With ``--settle`` it measures: the ties the stored rounds left are settled as ``Sweep.settle_ties`` would (the pick and
its tied rivals taking turns block by block on the stored artifacts, ``bench.duel``), in memory — the run is not
changed —, so a run recorded before duels existed is decided as this checkout would decide it. Run it alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from servopt.bench.launcher import launch
from servopt.contracts import Interleaved, Record
from servopt.families import FAMILIES
from servopt.families.base import Family
from servopt.optimize.candidates import unsettled
from servopt.optimize.decide import decide
from servopt.optimize.racing import DUEL_RIVALS, DUEL_SECONDS_PER_FIGURE
from servopt.optimize.rundir import RunDir, load_run
from servopt.optimize.sweep import duel_job


def settle(run: Path, targets: list, records: list[Record], ref: Record, family: Family, interleaved: Interleaved) -> Interleaved:
    """The duels ``Sweep.settle_ties`` would take on this run (two passes at most), in memory."""
    by_name = {r.name: r for r in records if r.status == "ok" and r.artifact is not None}
    for _ in range(2):
        names, asked = unsettled(targets, records, ref, family, interleaved, DUEL_RIVALS)
        if interleaved.covers(names, asked):
            break
        job = duel_job(names, by_name, RunDir(run).eval_data, asked, DUEL_SECONDS_PER_FIGURE)
        launched = launch(job, run / "work" / "redecide-duel")
        if launched.result is None:
            raise SystemExit(f"{run}: the duel failed: {launched.error}")
        for d in launched.result.duels:
            lo, hi = d.time_ratio_interval
            print(f"  duel {d.what}: {d.a} / {d.b} time {d.time_ratio:.3f} [{lo:.3f}, {hi:.3f}] in {d.pairs} pairs: {d.verdict}")
        interleaved = interleaved.with_duels(launched.result.duels)
    return interleaved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--family", default="image-classification", help="the run's model family")
    ap.add_argument("--settle", action="store_true", help="also take the duels this checkout's sweep would (measures)")
    args = ap.parse_args()
    family = FAMILIES.get(args.family)
    for run in args.runs:
        summary, records = load_run(run)
        if summary is None:
            raise SystemExit(f"{run}: no summary.json (the run did not finish)")
        il_path = run / "interleave.json"
        interleaved = Interleaved.model_validate_json(il_path.read_text()) if il_path.exists() else None
        ref = next(r for r in records if r.name == summary.reference)
        if args.settle and interleaved is not None:
            interleaved = settle(run, [t.target for t in summary.targets], records, ref, family, interleaved)
        for stored in summary.targets:
            d = decide(stored.target, records, ref, family, interleaved)
            now, then = d.pick, stored.pick
            print(f"{run} {stored.target.name}: {now} (stored: {then}{'' if now == then else ', CHANGED'}); tied: {', '.join(d.tied) or '-'}")


if __name__ == "__main__":
    main()
