"""Decide a finished run's targets again with this checkout's `decide()`: nothing is measured.

    PYTHONPATH=src python benchmarks/redecide.py RUN_DIR [RUN_DIR ...] [--family text-embedding]

The decision is a pure function of a run's records (`results.jsonl`) and its side-by-side figures
(`interleave.json`), so a change to the decision rule can be checked against every stored run — the racing benchmark's
full sweeps and races included — before spending the machine on new ones. Prints each target's pick (or nearest
miss) and the variants tied with it. (A run that also re-measured under an instruction-set cap decided those
targets on the capped figures; this uses the uncapped ones.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from servopt.contracts import Interleaved
from servopt.families import FAMILIES
from servopt.optimize.decide import decide
from servopt.optimize.rundir import load_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--family", default="image-classification", help="the run's model family")
    args = ap.parse_args()
    family = FAMILIES.get(args.family)
    for run in args.runs:
        summary, records = load_run(run)
        if summary is None:
            raise SystemExit(f"{run}: no summary.json (the run did not finish)")
        il_path = run / "interleave.json"
        interleaved = Interleaved.model_validate_json(il_path.read_text()) if il_path.exists() else None
        ref = next(r for r in records if r.name == summary.reference)
        for stored in summary.targets:
            d = decide(stored.target, records, ref, family, interleaved)
            now, then = d.recommended or d.nearest, stored.recommended or stored.nearest
            print(f"{run} {stored.target.name}: {now} (stored: {then}{'' if now == then else ', CHANGED'}); tied: {', '.join(d.tied) or '-'}")


if __name__ == "__main__":
    main()
