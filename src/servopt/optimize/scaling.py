"""From the cores measured here to the target's instance: fit how a variant scales, and project with an interval.

A target names an instance (``Target.instance_vcpus``); servopt runs on a machine with fewer (or other) cores. The
scaling job (``bench.scaling``) measures each candidate at 1, 2, … cores of this machine in the layout ``servopt
serve`` runs for throughput (one single-thread instance per core) and, for one request, one session with that many
threads. Two laws are fitted to those points:

- throughput: the Universal Scalability Law (Gunther), X(N) = λN / (1 + σ(N−1) + κN(N−1)): σ the share serialized
  (memory bandwidth, a shared cache), κ the cost of keeping the instances coherent. With two points κ cannot be told
  apart from σ and is taken as 0 (Amdahl's law for throughput), and the report says so; a superlinear measurement
  is held to linear (σ ≥ 0), so a projection never promises more than the cores;
- one request's latency: Amdahl's law, T(N) = T₁(1 − p + p/N), p the parallel share of a call.

The interval is a bootstrap over the rounds (each point's rounds resampled, the law refitted, the instance's figure
projected again): it carries the measurement's noise into the projection, not the law's own error — with two points
nothing can. A projection covers the core count, not another CPU: the verdict keeps saying where the figures came from.
Pure functions of the stored curves, like ``decide``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from servopt.contracts import Projection, ScalingCurve

BOOTSTRAP = 400
SEED = 20261127


@dataclass(frozen=True)
class Usl:
    """X(N) = λN / (1 + σ(N−1) + κN(N−1))."""

    lam: float
    sigma: float
    kappa: float

    def __call__(self, n: float) -> float:
        return self.lam * n / (1 + self.sigma * (n - 1) + self.kappa * n * (n - 1))

    def describe(self, points: int) -> str:
        if points < 3:
            law = "linear" if self.sigma < 1e-3 else f"Amdahl (USL with κ = 0: two points), σ = {self.sigma:.3f}"
        else:
            law = f"USL σ = {self.sigma:.3f}, κ = {self.kappa:.4f}"
        return f"{law}; λ = {self.lam:.1f}/s per core"


@dataclass(frozen=True)
class Amdahl:
    """T(N) = T₁(1 − p + p/N)."""

    t1: float
    p: float

    def __call__(self, n: float) -> float:
        return self.t1 * (1 - self.p + self.p / n)

    def describe(self) -> str:
        return f"Amdahl, parallel share p = {self.p:.2f}; T₁ = {self.t1:.2f} ms"


def fit_usl(cores: list[int], throughput: list[float]) -> Usl:
    """The USL through (cores, throughput): λ from one core when measured (else from the fit), σ and κ by least
    squares on N/C(N) − 1 = σ(N−1) + κN(N−1), each held ≥ 0."""
    n = np.asarray(cores, dtype=float)
    x = np.asarray(throughput, dtype=float)
    if len(n) == 0 or np.any(x <= 0):
        raise ValueError("a scaling fit needs positive throughput at one core count at least")
    lam = float(x[n == 1][0]) if np.any(n == 1) else float(x[0] / n[0])
    more = n > 1
    if not np.any(more):
        return Usl(lam, 0.0, 0.0)
    y = n[more] / (x[more] / lam) - 1
    a = np.column_stack([n[more] - 1, n[more] * (n[more] - 1)])
    if more.sum() < 2:  # one point past one core: σ alone (κ cannot be seen)
        return Usl(lam, max(0.0, float(y[0] / a[0, 0])), 0.0)
    (sigma, kappa), *_ = np.linalg.lstsq(a, y, rcond=None)
    if sigma < 0 or kappa < 0:  # the constrained optimum lies on an edge: refit the other alone
        s_only = max(0.0, float(a[:, 0] @ y / (a[:, 0] @ a[:, 0])))
        k_only = max(0.0, float(a[:, 1] @ y / (a[:, 1] @ a[:, 1])))
        err_s = float(np.sum((y - a[:, 0] * s_only) ** 2))
        err_k = float(np.sum((y - a[:, 1] * k_only) ** 2))
        sigma, kappa = (s_only, 0.0) if err_s <= err_k else (0.0, k_only)
    return Usl(lam, float(sigma), float(kappa))


def fit_amdahl(cores: list[int], p50_ms: list[float]) -> Amdahl:
    """Amdahl's law through (threads, latency): T₁ from one thread, p by least squares on T(N)/T₁ = 1 − p(1 − 1/N),
    held to [0, 1]."""
    n = np.asarray(cores, dtype=float)
    t = np.asarray(p50_ms, dtype=float)
    if not np.any(n == 1):
        raise ValueError("Amdahl's fit needs the one-thread latency")
    t1 = float(t[n == 1][0])
    more = n > 1
    if not np.any(more):
        return Amdahl(t1, 0.0)
    a = 1 - 1 / n[more]
    p = float(a @ (1 - t[more] / t1) / (a @ a))
    return Amdahl(t1, min(1.0, max(0.0, p)))


def medians(curve: ScalingCurve, which: str, rng: np.random.Generator | None = None) -> tuple[list[int], list[float]]:
    """Each point's median over its rounds (resampled with replacement when ``rng`` is given)."""
    cores, values = [], []
    for pt in curve.points:
        rounds = np.asarray(getattr(pt, which), dtype=float)
        if len(rounds) == 0:
            continue
        if rng is not None:
            rounds = rng.choice(rounds, size=len(rounds), replace=True)
        cores.append(pt.cores)
        values.append(float(np.median(rounds)))
    return cores, values


def _bootstrap(curve: ScalingCurve, which: str, project: Callable[[list[int], list[float]], float]) -> tuple[float, float, float]:
    """The projection on the medians, and its 95 % bootstrap interval."""
    central = project(*medians(curve, which))
    rng = np.random.default_rng(SEED)
    draws = [project(*medians(curve, which, rng)) for _ in range(BOOTSTRAP)]
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return central, float(min(lo, central)), float(max(hi, central))


def noise_words(curve: ScalingCurve) -> str:
    """"; noisy: …" when other processes used the machine during the curve's rounds, else ""."""
    from servopt.bench.scaling import noisy_rounds

    noisy, rounds, most = noisy_rounds(curve)
    if not noisy:
        return ""
    return (f"; noisy: other processes used up to {most:.0%} of the machine in {noisy} of {rounds} rounds, which the fit "
            "reads as the model's own scaling (rerun on a quiet machine)")


def why_not(curve: ScalingCurve | None) -> str | None:
    """Why a curve cannot be projected from, or None."""
    if curve is None:
        return "its scaling was not measured (only each target's candidates are)"
    if curve.error:
        return f"its scaling measurement failed: {curve.error}"
    counts = sorted({p.cores for p in curve.points})
    if len(counts) < 2:
        return f"scaling measured at {counts[0] if counts else 0} core(s) only: fewer than two points, nothing to fit"
    if 1 not in counts:
        return "scaling not measured at one core"
    return None


def offline_at(curve: ScalingCurve, cores: int) -> float | None:
    """The offline throughput at ``cores`` of this machine: the measured point's median, else the USL fit's."""
    if why_not(curve) is not None:
        return None
    counts, values = medians(curve, "throughput_ips")
    return values[counts.index(cores)] if cores in counts else fit_usl(counts, values)(cores)


@dataclass(frozen=True)
class ServedShare:
    """What serving kept of a variant's offline throughput here: its served capacity within the SLO over its offline
    figure at the same cores (HTTP, batching and the latency bound take the rest). A variant that was not served is
    judged at its offline figure × this share, so it is compared like with like beside a served one (an offline figure
    beside a served one always looks better, and would move the pick to whatever was not served)."""

    share: float
    variant: str
    cores: int  # the cores here it was served on


def served_share(curve: ScalingCurve | None, served_rps: float, cores: int | None, variant: str) -> ServedShare | None:
    """The share ``variant``'s served capacity (``served_rps`` samples/s on ``cores``) kept of its offline figure."""
    offline = offline_at(curve, cores or 1) if curve is not None else None
    if not offline or offline <= 0:
        return None
    return ServedShare(share=served_rps / offline, variant=variant, cores=cores or 1)


def project_throughput(curve: ScalingCurve, to_cores: int, served_rps: float | None = None, served_cores: int | None = None
                       ) -> Projection | None:
    """The instance's throughput: the USL fitted to the curve at ``to_cores``; with ``served_rps`` (a served capacity
    measured on ``served_cores`` here), that capacity scaled by the fit's X(to) / X(served_cores). None when the curve
    cannot be projected from (``why_not``)."""
    if why_not(curve) is not None:
        return None
    counts = sorted({p.cores for p in curve.points})
    measured = to_cores in counts

    def offline(cores: list[int], values: list[float]) -> float:
        if measured:
            return values[cores.index(to_cores)]
        return fit_usl(cores, values)(to_cores)

    def served(cores: list[int], values: list[float]) -> float:
        assert served_rps is not None and served_cores is not None
        law = fit_usl(cores, values)
        return served_rps * law(to_cores) / law(served_cores)

    basis: Literal["served", "offline"] = "served" if served_rps is not None else "offline"
    value, low, high = _bootstrap(curve, "throughput_ips", served if basis == "served" else offline)
    law = fit_usl(*medians(curve, "throughput_ips"))
    note = (f"measured at {to_cores} cores" if measured and basis == "offline" else
            f"projected from {len(counts)} core counts ({', '.join(map(str, counts))}) to {to_cores}")
    return Projection(figure="throughput_ips", basis=basis, to_cores=to_cores, cores_measured=counts, value=value, low=low,
                      high=high, model=law.describe(len(counts)), measured=measured and basis == "offline",
                      note=note + noise_words(curve))


def project_estimated(curve: ScalingCurve, to_cores: int, share: ServedShare) -> Projection | None:
    """A variant that was not served, its instance's throughput as if served: its offline figure on the cores the
    share was measured on × ``share`` (another variant's), projected like a served capacity."""
    offline = offline_at(curve, share.cores)
    proj = project_throughput(curve, to_cores, offline * share.share, share.cores) if offline else None
    if proj is None:
        return None
    return proj.model_copy(update={"basis": "estimated", "note": (
        f"not served: its offline figure × the {share.share:.0%} of its offline figure that {share.variant} kept served "
        f"within the SLO; {proj.note}")})


def project_latency(curve: ScalingCurve, to_cores: int) -> Projection | None:
    """One request's p50 on the instance, its call given ``to_cores`` threads: Amdahl's law fitted to the curve."""
    if why_not(curve) is not None:
        return None
    counts = sorted({p.cores for p in curve.points})
    measured = to_cores in counts

    def at(cores: list[int], values: list[float]) -> float:
        if measured:
            return values[cores.index(to_cores)]
        return fit_amdahl(cores, values)(to_cores)

    value, low, high = _bootstrap(curve, "p50_ms", at)
    law = fit_amdahl(*medians(curve, "p50_ms"))
    note = f"measured with {to_cores} threads" if measured else \
        f"projected from {len(counts)} thread counts ({', '.join(map(str, counts))}) to {to_cores}"
    return Projection(figure="p50_ms", to_cores=to_cores, cores_measured=counts, value=value, low=low, high=high,
                      model=law.describe(), measured=measured, note=note + noise_words(curve))


def band(curve: ScalingCurve, up_to: int) -> tuple[list[int], list[float], list[float], list[float]]:
    """Cores 1…``up_to`` and the fitted throughput with its 95 % band (the report's scaling chart)."""
    cores = list(range(1, max(up_to, 1) + 1))
    fits = [fit_usl(*medians(curve, "throughput_ips"))]
    rng = np.random.default_rng(SEED)
    draws = np.array([[fit_usl(*medians(curve, "throughput_ips", rng))(n) for n in cores] for _ in range(BOOTSTRAP)])
    lo, hi = np.percentile(draws, [2.5, 97.5], axis=0)
    return cores, [fits[0](n) for n in cores], [float(v) for v in lo], [float(v) for v in hi]
