"""Is servopt's cpu-server pick faster than the INT8 tools a user would reach for instead? (issues 11 and 15)

A thin wrapper over ``servopt compare`` (``servopt.peers``): the peers' answers built from the run's own fp32 ONNX model
and calibration samples, each in its own environment, measured side by side with the pick (a fresh process per
measurement, the order flipped each round), then issue 15's aim checked on ``compare.json``: among the peers within
``--tolerance`` points of the original's top-1, the pick gives at least 1.1x the best one's offline throughput and a
single-request p50 no slower, each read from the median of same-round ratios and its interval.

    PYTHONPATH=src .venv/bin/python benchmarks/peers_int8.py --run runs/demo [--target cpu-server] [--rounds 7]
        [--peers optimum,olive,nncf,neural-compressor] [--quick] [--out peers_int8.json]

The one-off script this replaced (``git show f797dd2:benchmarks/peers_int8.py``, with its builder ``peers_build.py``)
also built Optimum's percentiles and entropy calibrations and its avx512_vnni preset for an AVX2 target, Olive's search
over its quantization space, NNCF with accuracy control, and timed 1 and 2 threads; the peers build what each tool's
documentation does by default (docs/peers.md), and the figures docs/benchmarks.md quotes came from that script.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from servopt.peers.contracts import Comparison, PeerRatio, PeerResult

DEFAULT_PEERS = "optimum,olive,nncf,neural-compressor"
AIM_THROUGHPUT = 1.1  # pick ÷ best peer within tolerance, offline throughput: at least this (issue 15)
AIM_P50 = 1.0  # pick ÷ that peer, single-request p50: at most this (no slower)


def ratio(p: PeerResult, metric: str) -> PeerRatio | None:
    return next((r for r in p.ratios if r.metric == metric), None)


def verdict(c: Comparison, tolerance: float) -> dict:
    """Issue 15's aim on a comparison: the best peer within ``tolerance`` points by offline throughput, and the pick's
    throughput and p50 over it (1 / the peer ÷ pick ratios, intervals inverted)."""
    within = [p for p in c.peers if p.status == "ok" and p.quality_drop is not None and p.quality_drop <= tolerance
              and ratio(p, "throughput_ips") is not None]
    out: dict = {"pick": c.pick, "target": c.target, "rounds": c.rounds, "tolerance_points": tolerance,
                 "peers": {p.name: {"status": p.status, "why": p.why, "quality_drop": p.quality_drop,
                                    **{r.metric: [round(r.ratio, 3), round(r.low, 3), round(r.high, 3)] for r in p.ratios}}
                           for p in c.peers}}
    if not within:
        out["aim"] = "no peer ran within the tolerance: nothing to compare the aim with"
        return out
    best = max(within, key=lambda p: ratio(p, "throughput_ips").ratio)  # type: ignore[union-attr]
    tp, p50 = ratio(best, "throughput_ips"), ratio(best, "p50_ms")
    assert tp is not None
    pick_tp = (1 / tp.ratio, 1 / tp.high, 1 / tp.low)
    pick_p50 = (1 / p50.ratio, 1 / p50.high, 1 / p50.low) if p50 is not None else None
    met_tp = pick_tp[0] >= AIM_THROUGHPUT
    met_p50 = pick_p50 is not None and pick_p50[0] <= AIM_P50
    out.update(best_peer=best.name, pick_over_best_throughput=[round(x, 3) for x in pick_tp],
               pick_over_best_p50=[round(x, 3) for x in pick_p50] if pick_p50 else None,
               aim_met=met_tp and met_p50,
               aim=f"throughput {pick_tp[0]:.2f}x ({pick_tp[1]:.2f}-{pick_tp[2]:.2f}) of {best.name}'s, aim >= {AIM_THROUGHPUT}: "
                   f"{'met' if met_tp else 'not met'}; p50 "
                   + (f"{pick_p50[0]:.2f}x ({pick_p50[1]:.2f}-{pick_p50[2]:.2f}), aim <= {AIM_P50}: {'met' if met_p50 else 'not met'}"
                      if pick_p50 else "not measured"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a finished servopt optimize / demo run directory")
    ap.add_argument("--target", default="cpu-server")
    ap.add_argument("--peers", default=DEFAULT_PEERS)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tolerance", type=float, default=1.0, help="top-1 points a peer may lose against the original")
    ap.add_argument("--quick", action="store_true", help="the smoke protocol (figures mean nothing)")
    ap.add_argument("--out", type=Path, default=None, help="write the verdict as JSON here")
    args = ap.parse_args()
    from servopt.peers.compare import compare

    c = compare(args.run, [p.strip() for p in args.peers.split(",") if p.strip()], target=args.target, rounds=args.rounds,
                quick=args.quick, progress=lambda m: print(f"  {m}", flush=True))
    v = verdict(c, args.tolerance)
    for name, p in v["peers"].items():
        print(f"{name}: {p['status']}" + (f" ({p['why']})" if p["why"] else f", drop {p['quality_drop']}, "
                                          + ", ".join(f"{k} {r[0]}x ({r[1]}-{r[2]})" for k, r in p.items() if isinstance(r, list))))
    print(f"pick {v['pick']} for {v['target']}: {v['aim']}")
    if args.out:
        args.out.write_text(json.dumps(v, indent=1))


if __name__ == "__main__":
    main()
