"""Do two single-thread instances of each runtime compute twice what one does (issue 41)?

servopt's scaling measurement and its server run a throughput target as one single-thread instance per core, in one
process. For each variant of a finished run (default: the demo's ONNX Runtime fp32, OpenVINO fp32 and NNCF INT8,
torch eager), a fresh process (``bench.scaling.InstancesJob``, in the runtime's own environment where it has one)
opens two one-thread instances and a session with every core after them (as ``bench.scaling`` and ``servopt serve``
do), and runs one instance, then two, each from its own thread on full batches (``run_instances``): samples/s, the
cores' worth of CPU the process burned, the threads that burned it, and the cores the instances' threads were allowed
(an affinity mask of one core: pinned). Each OpenVINO variant (and the OpenVINO EP's) runs a second time pinned as it
was before issue 41 (``cpu_pinning=True``), the control of the same run.
Rounds flip the variants' order and the instance counts' order; the figure is the median per-round ratio of two
instances to one, with its order-statistics interval, and the rounds in which other processes used more than a
tenth of the machine are counted (a shared machine). Hold the benchmark lock:

    flock /tmp/servopt-bench.lock python benchmarks/instance_scaling.py --run runs/demo [--rounds 6] [--seconds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

DEFAULT = ["ort-fp32", "ov-fp32-latency", "nncf-int8-latency", "torch-eager"]
NOISY = 0.1  # others' share of the machine past which a round is flagged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, default=Path("runs/demo"))
    ap.add_argument("--variants", nargs="*", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=2.0, help="per figure, per round")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--no-control", action="store_true", help="leave out OpenVINO pinned as before (the control)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from servopt.bench.jobs import OpenSpec
    from servopt.bench.launcher import launch
    from servopt.bench.rounds import ratio_interval
    from servopt.bench.scaling import InstancesJob
    from servopt.machine import header, usable_cores
    from servopt.optimize.rundir import load_run

    if usable_cores() < 2:
        sys.exit("two instances need two usable cores")
    _, records = load_run(args.run)
    by = {r.name: r for r in records if r.status == "ok" and r.artifact is not None}
    contenders: dict[str, tuple[OpenSpec, dict[str, str]]] = {}
    for name in args.variants:
        rec = by.get(name)
        if rec is None:
            print(f"{name}: not in {args.run} (or did not run): skipped")
            continue
        spec = OpenSpec(name=name, artifact=rec.artifact.opened(), runtime=rec.runtime, options=rec.options)
        contenders[name] = (spec, dict(rec.env))
        if rec.runtime in ("openvino", "onnxruntime-openvino") and not args.no_control:
            pinned = spec.model_copy(update={"name": f"{name} pinned (before)", "options": {**rec.options, "cpu_pinning": True}})
            contenders[pinned.name] = (pinned, dict(rec.env))
    data = args.run / "data" / "eval.npz"
    work = args.run / "work" / "instance-scaling"
    print(f"CPU: {header()}; {args.rounds} rounds of {args.seconds:g} s per figure, batch {args.batch}, a fresh process "
          "per variant per round (InstancesJob), the variants' order and the instance counts' order flipped each round "
          "(shared machine)", flush=True)
    rows: dict[str, list[dict]] = {n: [] for n in contenders}
    names = list(contenders)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            spec, env = contenders[name]
            job = InstancesJob(session=spec, data=str(data), batch_size=args.batch, seconds=args.seconds,
                               counts=[1, 2] if r % 2 == 0 else [2, 1], env=env)
            launched = launch(job, work / f"{name.replace(' ', '_')}-{r}")
            if launched.result is None:
                print(f"  round {r + 1} {name}: failed: {launched.failure.error if launched.failure else '?'}", flush=True)
                continue
            row = {str(run.instances): run.model_dump() | {"cores_busy": run.cores_busy, "busy_threads": run.busy_threads()}
                   for run in launched.result.runs}
            rows[name].append(row)
            one, two = row["1"], row["2"]
            print(f"  round {r + 1} {name:34} 1: {one['samples_per_s']:7.1f}/s ({one['cores_busy']:.2f} cores)  "
                  f"2: {two['samples_per_s']:7.1f}/s ({two['cores_busy']:.2f} cores, {two['busy_threads']} busy threads, "
                  f"allowed {two['caller_cores']})  others {max(one['other_share'], two['other_share']):.0%}", flush=True)
    print(f"\n{'variant':36} {'1 instance/s':>12} {'2 instances/s':>13} {'2 / 1 [95% interval]':>24} {'cores busy at 2':>15} "
          f"{'busy threads':>12} {'noisy rounds':>12} {'2 / 1, quiet rounds':>20}")
    summary = {}
    for name, got in rows.items():
        if not got:
            continue
        ratios = [g["2"]["samples_per_s"] / g["1"]["samples_per_s"] for g in got]
        ratio, lo, hi, cov = ratio_interval(ratios)
        one = statistics.median(g["1"]["samples_per_s"] for g in got)
        two = statistics.median(g["2"]["samples_per_s"] for g in got)
        cores = statistics.median(g["2"]["cores_busy"] for g in got)
        threads = sorted({g["2"]["busy_threads"] for g in got})
        noisy = [max(g["1"]["other_share"], g["2"]["other_share"]) > NOISY for g in got]
        # another process on one of two cores caps two instances near one core's worth: the rounds nobody else ran
        quiet = [x for x, n in zip(ratios, noisy, strict=True) if not n]
        quiet_text = f"{statistics.median(quiet):.2f}x ({len(quiet)} rounds)" if quiet else "none quiet"
        summary[name] = {"one_per_s": one, "two_per_s": two, "ratio": ratio, "interval": [lo, hi], "coverage": cov,
                         "cores_busy_at_two": cores, "busy_threads_at_two": threads, "noisy_rounds": sum(noisy),
                         "quiet_ratios": quiet, "rounds": got}
        print(f"{name:36} {one:12.1f} {two:13.1f} {ratio:8.2f}x [{lo:.2f}, {hi:.2f}] {cores:15.2f} "
              f"{'/'.join(map(str, threads)):>12} {sum(noisy):>9}/{len(got)} {quiet_text:>20}")
    if args.out:
        args.out.write_text(json.dumps({"cpu": header(), "rounds": args.rounds, "seconds": args.seconds, "batch": args.batch,
                                        "variants": summary}, indent=1))


if __name__ == "__main__":
    main()
