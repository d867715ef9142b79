"""Does the price's band hold the served capacity's spread (issue 42)? Repeat a run's capacity search for a target's
pick and compare each search's figure with the band the run priced it on.

A run searches the pick's capacity once; its band holds the next search within the served allowance
(``optimize.allowance.served_spread``: ±20 % stated, widened by any step missed below the capacity). This script
serves the pick again (a fresh ``servopt serve`` in the configuration the run found, under the run's instruction-set
cap), runs the same rate search (``serve.capacity.SWEEP_RULES``, the same requests: the user's evaluation data as the
target's clients send it) ``--searches`` times, and says whether every figure lies within [low, high] × the run's
capacity. Hold the benchmark lock (nothing else may run beside a capacity search on two cores):

    flock /tmp/servopt-bench.lock python benchmarks/capacity_repeat.py RUN --target cpu-server [--searches 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from servopt.machine import cpu_features, cpu_model
from servopt.optimize.instance import run_served_data, server_cap
from servopt.optimize.rundir import load_config, load_run
from servopt.serve.capacity import SWEEP_RULES
from servopt.serve.harness import ServerProcess
from servopt.serve.ratesearch import measure_capacity, parse_slo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--target", required=True)
    ap.add_argument("--searches", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, help="a short step's least length (default: the sweep's)")
    ap.add_argument("--json", type=Path, help="every search's steps, to this file")
    args = ap.parse_args()
    summary, records = load_run(args.run)
    decision = summary.decision(args.target) if summary else None
    cap = decision.capacity if decision else None
    if cap is None or cap.config is None or cap.capacity_rps <= 0:
        raise SystemExit(f"{args.run} has no confirmed capacity for {args.target}: nothing to repeat")
    served = [a for b in decision.verdict.bounds if b.projection is not None for a in b.projection.allowances
              if a.what == "served"]
    band = (served[0].low, served[0].high) if served else None
    slo = parse_slo(cap.slo.replace(" ", "").replace("<=", "="))
    config = load_config(args.run)
    target = next(t for t in config.targets if t.name == args.target)
    rec = next(r for r in records if r.name == cap.variant)
    env = server_cap(target, rec)
    print(f"# {cpu_model()} ({cpu_features().level}); {cap.variant} within {cap.slo}: the run found "
          f"{cap.capacity_rps:.1f} req/s ({cap.config.label}){f', served under {env}' if env else ''}; its band "
          + (f"×{band[0]:.2f}–{band[1]:.2f}" if band else "has no served allowance"), flush=True)
    data = run_served_data(args.run, args.target)
    rules = SWEEP_RULES if args.min_seconds is None else SWEEP_RULES.model_copy(update={"min_seconds": args.min_seconds})
    figures, results = [], []
    for i in range(args.searches):
        with ServerProcess(args.run, "--variant", cap.variant, *cap.config.serve_args(), "--name", "m", env=env) as server:
            result, _ = measure_capacity(server.url, "m", slo, cap.knee_rps or cap.capacity_rps, rules, data=data)
        figures.append(result.capacity_rps)
        results.append(result.model_dump(mode="json"))
        confirming = [f"{s.p99_ms:.1f}" for s in result.steps if s.confirming and s.p99_ms is not None]
        print(f"search {i + 1}: {result.capacity_rps:.1f} req/s ({'confirmed' if result.confirmed else 'not confirmed'}; "
              f"knee {result.knee_rps:.1f}; confirming p99s {', '.join(confirming)} ms; {len(result.steps)} steps)", flush=True)
    ratios = [f / cap.capacity_rps for f in figures]
    within = band is not None and all(band[0] - 1e-9 <= r <= band[1] + 1e-9 for r in ratios)
    print(f"the run's {cap.capacity_rps:.1f}/s against {len(figures)} searches {', '.join(f'{f:.1f}' for f in figures)} "
          f"(×{min(ratios):.2f}–{max(ratios):.2f}, median {statistics.median(figures):.1f}): "
          f"{'within' if within else 'OUTSIDE'} its band" + (f" ×{band[0]:.2f}–{band[1]:.2f}" if band else ""))
    print(json.dumps({"capacity": cap.capacity_rps, "band": band, "searches": figures, "within": within, "cpu": cpu_model()}))
    if args.json:
        args.json.write_text(json.dumps({"capacity": cap.capacity_rps, "band": band, "rules": rules.model_dump(mode="json"),
                                         "searches": results}, indent=1))


if __name__ == "__main__":
    main()
