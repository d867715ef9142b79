"""Check every variant against every target, pick the best per target, and say why.

A bound is ``pass``, ``fail`` or ``not measured`` (edge latency must be measured
on the device; a GPU target without a GPU here). Figures re-measured in the
interleaved run (A B A B with the reference) replace the sweep's figures for
the decision, so close calls are decided on same-run numbers.
"""

from __future__ import annotations

from servopt.bench.environment import gpu_present, machine_label
from servopt.optimize.targets import Target


def accuracy_drop(rec: dict, ref: dict | None) -> float | None:
    """Points of top-1 lost against the original; from agreement when there are no labels."""
    acc, ref_acc = rec.get("accuracy"), (ref or {}).get("accuracy")
    if acc and ref_acc:
        return (ref_acc["top1"] - acc["top1"]) * 100
    agr = rec.get("agreement") or {}
    if "top1_agreement" in agr:
        return (1 - agr["top1_agreement"]) * 100
    return 0.0 if ref is not None and rec.get("name") == ref.get("name") else None


def figures(rec: dict, interleaved: dict | None) -> dict:
    """p50 and batch throughput, from the interleaved run where it re-measured this variant."""
    il = (interleaved or {}).get("variants", {}).get(rec["name"])
    if il:
        return {"p50_ms": il["p50_ms"], "throughput_ips": il["throughput_ips"], "source": "interleaved"}
    return {"p50_ms": (rec.get("latency_ms") or {}).get("p50"), "throughput_ips": (rec.get("throughput_ips") or {}).get("batch"),
            "source": "sweep"}


def eligible(target: Target, rec: dict) -> bool:
    if rec.get("status") != "ok":
        return False
    return bool(rec.get("needs_gpu")) == (target.device == "gpu")


def judge(target: Target, rec: dict, ref: dict | None, interleaved: dict | None = None) -> dict:
    """The verdict of one variant against one target, bound by bound."""
    fig = figures(rec, interleaved)
    machine = machine_label()
    bounds = []

    def add(bound: str, limit: float, value: float | None, upper: bool, measurable: bool, note: str) -> None:
        if not measurable or value is None:
            status = "not measured"
        else:
            status = "pass" if (value <= limit if upper else value >= limit) else "fail"
        miss = None
        if status == "fail" and value is not None:
            miss = value / limit - 1 if upper else 1 - value / limit  # over the bound / short of it, as a share of it
        bounds.append({"bound": bound, "limit": limit, "value": value, "status": status, "miss": miss, "note": note})

    drop = accuracy_drop(rec, ref)
    add("accuracy_drop_points", target.max_accuracy_drop, drop, True, drop is not None, "against the original model")
    if target.max_size_mb is not None:
        add("size_mb", target.max_size_mb, rec.get("size_mb"), True, True, "size on disk holds everywhere")
    speed_here = target.device == "cpu" or (target.device == "gpu" and gpu_present())
    speed_note = (f"measured on {machine}, not on {target.hardware}" if speed_here
                  else "measure on the device with `servopt bench`" if target.device == "edge"
                  else "not measured: no GPU on this machine")
    if target.max_p50_ms is not None:
        add("p50_ms", target.max_p50_ms, fig["p50_ms"], True, speed_here, speed_note)
    if target.min_throughput_ips is not None:
        add("throughput_ips", target.min_throughput_ips, fig["throughput_ips"], False, speed_here, speed_note)
    statuses = {b["status"] for b in bounds}
    return {
        "variant": rec["name"],
        "passes": "fail" not in statuses,
        "bounds": bounds,
        "figures": fig,
        "total_miss": sum(b["miss"] or 0 for b in bounds if b["status"] == "fail"),
    }


def _objective_key(target: Target, verdict: dict) -> float:
    f = verdict["figures"]
    if target.objective == "throughput":
        return -(f["throughput_ips"] or 0.0)
    return f["p50_ms"] if f["p50_ms"] is not None else float("inf")


def decide(target: Target, records: list[dict], ref: dict | None, interleaved: dict | None = None) -> dict:
    """Best passing variant under the target's objective, or the nearest miss and by how much."""
    candidates = [r for r in records if eligible(target, r)]
    skipped = [r["name"] for r in records if r.get("status") == "skipped" and bool(r.get("needs_gpu")) == (target.device == "gpu")]
    if target.device == "gpu" and not gpu_present():
        return {"target": target.model_dump(), "status": "not measured", "recommended": None, "verdicts": [],
                "reason": f"no GPU on this machine; GPU variants skipped: {', '.join(skipped) or 'none'}"}
    verdicts = [judge(target, r, ref, interleaved) for r in candidates]
    # Decide on one source of figures: when the top candidates were re-measured side by side, pick among them
    # (comparing a sweep figure with an interleaved one would compare two different moments of a noisy machine).
    side_by_side = [v for v in verdicts if v["figures"]["source"] == "interleaved"]
    pool = side_by_side if target.device == "cpu" and side_by_side else verdicts
    passing = sorted((v for v in pool if v["passes"]), key=lambda v: _objective_key(target, v))
    objective = "highest batch throughput" if target.objective == "throughput" else "lowest p50 latency"
    if passing:
        best = passing[0]
        runner_up = passing[1]["variant"] if len(passing) > 1 else None
        pending = [b["bound"] for b in best["bounds"] if b["status"] == "not measured"]
        reason = f"{best['variant']}: meets every bound here with the {objective}"
        if runner_up:
            reason += f" (next: {runner_up})"
        if pending:
            reason += f"; still to measure on {target.hardware}: {', '.join(pending)}"
        elif target.device == "cpu":
            reason += f" (figures from {machine_label()}, not from {target.hardware})"
        return {"target": target.model_dump(), "status": "pass" if not pending else "pass (pending device)",
                "recommended": best["variant"], "verdict": best, "verdicts": verdicts, "reason": reason}
    if not verdicts:
        return {"target": target.model_dump(), "status": "no candidate", "recommended": None, "verdicts": [],
                "reason": "no variant ran successfully for this target"}
    nearest = min(pool, key=lambda v: (v["total_miss"], _objective_key(target, v)))
    misses = ", ".join(
        f"{b['bound']} {b['value']:.3g} vs {'≤' if b['bound'] != 'throughput_ips' else '≥'} {b['limit']:g} "
        f"({'short' if b['bound'] == 'throughput_ips' else 'over'} by {b['miss']:.0%})"
        for b in nearest["bounds"] if b["status"] == "fail"
    )
    return {"target": target.model_dump(), "status": "fail", "recommended": None, "nearest": nearest["variant"],
            "verdict": nearest, "verdicts": verdicts, "reason": f"no variant passes; nearest is {nearest['variant']}: {misses}"}


def pareto_front(records: list[dict], ref: dict | None) -> list[str]:
    """Variants no other variant beats on all of p50, batch throughput, size and accuracy."""
    pts = []
    for r in records:
        if r.get("status") != "ok" or r.get("needs_gpu"):
            continue
        drop = accuracy_drop(r, ref)
        lat, tp = (r.get("latency_ms") or {}).get("p50"), (r.get("throughput_ips") or {}).get("batch")
        if None in (drop, lat, tp):
            continue
        pts.append((r["name"], (lat, -tp, r["size_mb"], drop)))

    def dominates(a: tuple, b: tuple) -> bool:
        return all(x <= y for x, y in zip(a, b, strict=True)) and any(x < y for x, y in zip(a, b, strict=True))

    return [n for n, p in pts if not any(dominates(q, p) for _, q in pts)]


def interleave_candidates(targets: list[Target], records: list[dict], ref: dict | None, per_target: int = 3) -> list[str]:
    """The top few variants per CPU target (passing first), to be re-measured side by side."""
    chosen: list[str] = []
    for t in targets:
        if t.device != "cpu":
            continue
        verdicts = [judge(t, r, ref) for r in records if eligible(t, r)]
        acc_ok = [v for v in verdicts if all(b["status"] != "fail" for b in v["bounds"] if b["bound"] == "accuracy_drop_points")]
        ranked = sorted(acc_ok, key=lambda v: (not v["passes"], _objective_key(t, v)))
        for v in ranked[:per_target]:
            if v["variant"] not in chosen:
                chosen.append(v["variant"])
    return chosen
