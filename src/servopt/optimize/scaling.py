"""From the cores measured here to the target's instance: fit how a variant scales, and project with a band.

A target names an instance (``Target.instance_vcpus``, as physical cores × ``threads_per_core``); servopt runs on a
machine with fewer (or other) cores. The scaling job (``bench.scaling``) measures each candidate at 1, 2, … vCPUs of
this machine in the layout ``servopt serve`` runs for throughput (one single-thread instance per vCPU) and, for one
request, one session with that many threads. The law is fitted per physical core (``optimize.layout``):

- throughput: the Universal Scalability Law (Gunther) across physical cores, X(N) = λN / (1 + σ(N−1) + κN(N−1)): σ
  the share serialized (memory bandwidth, a shared cache), κ the cost of keeping the instances coherent. With two
  points κ cannot be told apart from σ and is taken as 0 (Amdahl's law for throughput), and the report says so; a
  superlinear measurement is held to linear (σ ≥ 0). A core's second thread adds the SMT factor, measured where the
  host has siblings, else assumed with its range. The instance's figure is never below one measured on fewer vCPUs;
- one request's latency: Amdahl's law, T(N) = T₁(1 − p + p/N), N the core-equivalents its threads give (a core's
  second thread counts as SMT's share of a core).

The band: a bootstrap over the rounds (each point's rounds resampled, the law refitted, the instance's figure
projected again; a served figure drawn from the repeated capacity searches), its low end with every unmeasured factor
at its pessimistic end and its high end at its optimistic one, then widened by the allowances (``optimize.allowance``:
one search's spread, the CPU change). It does not carry the law's own error: ``check`` tests the law where the host
can — fitted on one vCPU, the second predicted and compared with the one measured. A projection covers the core
count, not another CPU: the verdict keeps saying where the figures came from. Pure functions of the stored curves,
like ``decide``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from servopt.contracts import Allowance, Projection, ProjectionCheck, Scaling, ScalingCurve, Topology
from servopt.optimize.layout import CORES, SMT, CoreLaw, HostReading, read_host, topology_reading

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


def two_over_one(curve: ScalingCurve) -> float | None:
    """Two single-thread instances' throughput over one's (medians), where both were measured."""
    counts, values = medians(curve, "throughput_ips")
    return values[counts.index(2)] / values[counts.index(1)] if 1 in counts and 2 in counts and values[counts.index(1)] else None


def run_ratio(scaling: Scaling | None) -> float | None:
    """The highest two-over-one ratio any variant of the run showed: what the host's second vCPU can give. The host is
    one machine for every variant; a variant that scaled less contends across the cores (its σ), it does not make the
    second vCPU a hyperthread (the image demo read as AVX2: ORT fp32 1.89x, OpenVINO INT8 1.95x, two ORT INT8 recipes
    1.56x and 1.63x read as one core's two threads, and projected twice what their own σ does; 2026-11-29, Zen 4)."""
    ratios = [r for c in (scaling.curves.values() if scaling else []) if why_not(c) is None and (r := two_over_one(c))]
    return max(ratios, default=None)


def host_reading(curve: ScalingCurve, topology: Topology | None, run: float | None = None) -> HostReading:
    """How this machine's points are read (``layout.read_host``): its sibling lists, the curve's 1 → 2 step's ratio,
    and the highest the run's variants showed (``run_ratio``)."""
    counts, _ = medians(curve, "throughput_ips")
    cpus = topology.cpus if topology is not None else max(counts, default=1)
    return read_host(topology, two_over_one(curve), cpus, run)


@dataclass(frozen=True)
class Fitted:
    law: CoreLaw
    sigma_measured: bool  # two points across physical cores at least
    smt_measured: bool  # a point on a core's second thread


def fit_law(counts: list[int], values: list[float], host: HostReading, smt: float = SMT.central,
            sigma: float = CORES.central) -> Fitted:
    """The per-core law through the points: the USL across the points that each added a core (``host``), ``sigma``
    where only one core was measured; the SMT factor from the highest point on second threads, ``smt`` where none."""
    pts = dict(zip(counts, values, strict=True))
    cross = sorted(n for n in pts if n <= host.cores)
    if len(cross) >= 2:
        usl = fit_usl(cross, [pts[n] for n in cross])
        sigma_measured = True
    else:
        usl, sigma_measured = Usl(pts[1], sigma, 0.0), False
    law = CoreLaw(usl.lam, usl.sigma, usl.kappa, smt)
    second = [n for n in pts if host.cores < n <= host.cores * host.threads]
    if not second:
        return Fitted(law, sigma_measured, False)
    cores, vcpus = host.layout(max(second))
    measured = (pts[max(second)] / law.cores_only(cores) - 1) * cores / (vcpus - cores) + 1
    return Fitted(CoreLaw(usl.lam, usl.sigma, usl.kappa, measured), sigma_measured, True)


@dataclass(frozen=True)
class Shape:
    """The target's instance: ``vcpus`` on ``vcpus / threads`` physical cores."""

    vcpus: int
    threads: int = 1

    @property
    def cores(self) -> int:
        return max(1, self.vcpus // self.threads)

    @property
    def words(self) -> str:
        return f"{self.cores} core{'s' if self.cores > 1 else ''} × {self.threads} thread{'s' if self.threads > 1 else ''}"


@dataclass(frozen=True)
class Served:
    """A served capacity to project (samples/s on ``cores`` vCPUs here): one search's, or each of repeated searches'
    (at least three are drawn from as measured; fewer stand for their median, their spread an allowance)."""

    figures: tuple[float, ...]
    cores: int

    @property
    def central(self) -> float:
        return float(np.median(self.figures))

    @property
    def drawn(self) -> bool:
        return len(self.figures) >= 3


def _shape(to: Shape | int) -> Shape:
    return to if isinstance(to, Shape) else Shape(to, 1)


def _assumed(fit: Fitted, to: Shape, host: HostReading) -> list[str]:
    """The factors the projection to ``to`` takes from assumptions, in words."""
    out = []
    if not fit.sigma_measured and to.cores > 1:
        out.append(CORES.words("contention across cores σ (one core measured here)"))
    if not fit.smt_measured and to.vcpus > to.cores:
        out.append(SMT.words("a core's second thread"))
    return out


def _layout_words(to: Shape, host: HostReading, fit: Fitted) -> str:
    smt = f"; SMT ×{fit.law.smt:.2f} measured" if fit.smt_measured else ""
    return f"{to.vcpus} vCPUs = {to.words}, projected per physical core; here: {host.words}{smt}"


def _band(central: float, pess: list[float], opt: list[float], allowances: Sequence[Allowance], higher_is_better: bool
          ) -> tuple[float, float]:
    """The band's ends: the pessimistic draws' 2.5 % and the optimistic draws' 97.5 % (the other way round for a
    latency), holding the central figure, times the allowances."""
    if higher_is_better:
        lo, hi = float(np.percentile(pess, 2.5)), float(np.percentile(opt, 97.5))
    else:
        lo, hi = float(np.percentile(opt, 2.5)), float(np.percentile(pess, 97.5))
    lo, hi = min(lo, central), max(hi, central)
    for a in allowances:
        lo, hi = (lo * a.low, hi * a.high) if higher_is_better else (lo / a.high, hi / a.low)
    return lo, hi


def project_throughput(curve: ScalingCurve, to: Shape | int, topology: Topology | None = None, served: Served | None = None,
                       allowances: Sequence[Allowance] = (), run: float | None = None) -> Projection | None:
    """The instance's throughput: the per-core law fitted to the curve at ``to``'s cores × threads; with ``served`` (a
    served capacity measured here), that capacity scaled by the law's X(instance) / X(the layout it was served on).
    Never below a figure measured (or served) on fewer vCPUs. None when the curve cannot be projected from
    (``why_not``). ``run``: the run's ``run_ratio``, read with the curve's own."""
    if why_not(curve) is not None:
        return None
    to = _shape(to)
    host = host_reading(curve, topology, run)
    counts = sorted({p.cores for p in curve.points})
    measured = to.vcpus in counts and host.layout(to.vcpus) == (to.cores, to.vcpus) and served is None

    def figure(cores: list[int], values: list[float], smt: float, sigma: float, served_rps: float | None) -> tuple[float, float]:
        """(the law's figure, the floor it may not go below)."""
        if measured:
            return values[cores.index(to.vcpus)], 0.0
        law = fit_law(cores, values, host, smt, sigma).law
        x = law(to.cores, to.vcpus)
        if served_rps is not None and served is not None:
            return served_rps * x / law(*host.layout(served.cores)), served_rps if served.cores < to.vcpus else 0.0
        # strictly fewer vCPUs: the host's 2 cores may outrun an instance's 2 vCPUs on one core
        return x, max((v for n, v in zip(cores, values, strict=True) if n < to.vcpus), default=0.0)

    central_rps = served.central if served is not None else None
    raw, floor = figure(*medians(curve, "throughput_ips"), SMT.central, CORES.central, central_rps)
    value = max(raw, floor)
    rng = np.random.default_rng(SEED)
    pess, opt = [], []
    for _ in range(BOOTSTRAP):
        cores, values = medians(curve, "throughput_ips", rng)
        rps = float(rng.choice(served.figures)) if served is not None and served.drawn else central_rps
        pess.append(figure(cores, values, SMT.pessimistic, CORES.pessimistic, rps))
        opt.append(max(figure(cores, values, SMT.optimistic, CORES.optimistic, rps)))
    floored = raw < floor or float(np.percentile([x - f for x, f in pess], 2.5)) < 0  # the band's low end was held
    low, high = _band(value, [max(d) for d in pess], opt, allowances, True)
    fit = fit_law(*medians(curve, "throughput_ips"), host)
    basis: Literal["served", "offline"] = "served" if served is not None else "offline"
    note = (f"measured at {to.vcpus} vCPUs" if measured else
            f"projected from {len(counts)} vCPU counts ({', '.join(map(str, counts))}) to {to.vcpus}")
    if floored:
        note += f" (held at the figure {'served' if served else 'measured'} on fewer vCPUs where the law went below it)"
    if served is not None and served.drawn:
        note += f"; drawn from {len(served.figures)} capacity searches ({', '.join(f'{f:,.0f}' for f in served.figures)}/s)"
    return Projection(figure="throughput_ips", basis=basis, to_cores=to.vcpus, cores_measured=counts, value=value, low=low,
                      high=high, model=_describe(fit, len([n for n in counts if n <= host.cores])), measured=measured,
                      note=note + noise_words(curve), layout=_layout_words(to, host, fit),
                      assumed=[] if measured else _assumed(fit, to, host), allowances=list(allowances), floored=floored,
                      check=check(curve, topology))


def _describe(fit: Fitted, cross_points: int) -> str:
    law = fit.law
    usl = Usl(law.lam, law.sigma, law.kappa).describe(cross_points) if fit.sigma_measured else \
        f"one core measured: σ assumed {law.sigma:g}; λ = {law.lam:.1f}/s per core"
    return usl + (f"; SMT ×{law.smt:.2f} (measured)" if fit.smt_measured else "")


def check(curve: ScalingCurve, topology: Topology | None) -> ProjectionCheck | None:
    """The law where it can be checked: fitted on the one-vCPU rounds alone, the host read from its sibling lists only
    (a second vCPU is a core, or a core's second thread, with its factor at its stated range), the two-vCPU figure
    predicted and compared with the one measured, which the fit never saw. None without both points."""
    counts, values = medians(curve, "throughput_ips")
    if 1 not in counts or 2 not in counts:
        return None
    host = topology_reading(topology, topology.cpus if topology is not None else max(counts))
    layout = host.layout(2)

    def predict(lam: float, smt: float, sigma: float) -> float:
        return max(fit_law([1], [lam], host, smt, sigma).law(*layout), lam)  # never below the one vCPU measured

    one = next(p for p in curve.points if p.cores == 1)
    predicted = predict(values[counts.index(1)], SMT.central, CORES.central)
    rng = np.random.default_rng(SEED)
    lams = [float(np.median(rng.choice(one.throughput_ips, size=len(one.throughput_ips)))) for _ in range(BOOTSTRAP)]
    low = min(predicted, float(np.percentile([predict(x, SMT.pessimistic, CORES.pessimistic) for x in lams], 2.5)))
    high = max(predicted, float(np.percentile([predict(x, SMT.optimistic, CORES.optimistic) for x in lams], 97.5)))
    measured = values[counts.index(2)]
    what = "a core's second thread" if layout[0] == 1 else "a second core"
    return ProjectionCheck(predicted=predicted, low=low, high=high, measured=measured, error=measured / predicted - 1,
                           within=low <= measured <= high, reading=f"the second vCPU read as {what} ({host.words})")


def check_words(c: ProjectionCheck) -> str:
    """"1 → 2 vCPUs: predicted 190/s (182–200) from one, measured 195/s (+2.6 %): within its band"."""
    return (f"1 → 2 vCPUs: predicted {c.predicted:,.0f}/s ({c.low:,.0f}–{c.high:,.0f}) from one, measured "
            f"{c.measured:,.0f}/s ({c.error:+.1%}): {'within' if c.within else 'OUTSIDE'} its band; {c.reading}")


@dataclass(frozen=True)
class ServedShare:
    """What serving kept of a variant's offline throughput here: its served capacity within the SLO over its offline
    figure at the same cores (HTTP, batching and the latency bound take the rest). A variant that was not served is
    judged at its offline figure × this share, so it is compared like with like beside a served one (an offline figure
    beside a served one always looks better, and would move the pick to whatever was not served). At most 1: a server
    adds no throughput to the model's own."""

    share: float
    variant: str
    cores: int  # the cores here it was served on
    runtime: str | None = None
    spread: Allowance | None = None  # its searches' spread (``allowance.served_spread``): an estimate from it carries it


def served_share(curve: ScalingCurve | None, served_rps: float, cores: int | None, variant: str,
                 runtime: str | None = None) -> ServedShare | None:
    """The share ``variant``'s served capacity (``served_rps`` samples/s on ``cores``) kept of its offline figure,
    held to 1 (a served figure over the offline one is the machine's noise between the two, not a server's gain)."""
    offline = offline_at(curve, cores or 1) if curve is not None else None
    if not offline or offline <= 0:
        return None
    return ServedShare(share=min(1.0, served_rps / offline), variant=variant, cores=cores or 1, runtime=runtime)


def project_estimated(curve: ScalingCurve, to: Shape | int, share: ServedShare, topology: Topology | None = None,
                      allowances: Sequence[Allowance] = (), run: float | None = None) -> Projection | None:
    """A variant that was not served, its instance's throughput as if served: its offline figure on the cores the
    share was measured on × ``share`` (another variant's), projected like a served capacity."""
    offline = offline_at(curve, share.cores)
    proj = project_throughput(curve, to, topology, Served((offline * share.share,), share.cores), allowances, run) if offline else None
    if proj is None:
        return None
    return proj.model_copy(update={"basis": "estimated", "note": (
        f"not served: its offline figure × the {share.share:.0%} of its offline figure that {share.variant} kept served "
        f"within the SLO; {proj.note}")})


def project_latency(curve: ScalingCurve, to: Shape | int, topology: Topology | None = None, run: float | None = None
                    ) -> Projection | None:
    """One request's p50 on the instance, its call given every vCPU's thread: Amdahl's law over the core-equivalents
    the threads give (a core's second thread counts as the SMT factor's share of a core), fitted to the curve."""
    if why_not(curve) is not None:
        return None
    to = _shape(to)
    host = host_reading(curve, topology, run)
    counts = sorted({p.cores for p in curve.points})
    measured = to.vcpus in counts and host.layout(to.vcpus) == (to.cores, to.vcpus)
    tp = medians(curve, "throughput_ips")

    def at(cores: list[int], values: list[float], smt: float) -> float:
        if measured:
            return values[cores.index(to.vcpus)]
        law = fit_law(*tp, host, smt).law
        fit = fit_amdahl([law.effective(*host.layout(n)) for n in cores], values)
        return fit(law.effective(to.cores, to.vcpus))

    value = at(*medians(curve, "p50_ms"), SMT.central)
    rng = np.random.default_rng(SEED)
    pess, opt = [], []
    for _ in range(BOOTSTRAP):
        cores, values = medians(curve, "p50_ms", rng)
        pess.append(at(cores, values, SMT.pessimistic))
        opt.append(at(cores, values, SMT.optimistic))
    low, high = _band(value, pess, opt, (), False)
    fit = fit_law(*tp, host)
    law = fit_amdahl([fit.law.effective(*host.layout(n)) for n in counts], medians(curve, "p50_ms")[1])
    note = f"measured with {to.vcpus} threads" if measured else \
        f"projected from {len(counts)} thread counts ({', '.join(map(str, counts))}) to {to.vcpus}"
    return Projection(figure="p50_ms", to_cores=to.vcpus, cores_measured=counts, value=value, low=low, high=high,
                      model=law.describe(), measured=measured, note=note + noise_words(curve),
                      layout=_layout_words(to, host, fit), assumed=[] if measured or fit.smt_measured or to.vcpus == to.cores
                      else [SMT.words("a core's second thread")])


def band(curve: ScalingCurve, up_to: int, topology: Topology | None = None, threads: int = 1, run: float | None = None
         ) -> tuple[list[int], list[float], list[float], list[float]]:
    """vCPUs 1…``up_to`` of an instance with ``threads`` per core, and the fitted throughput with its 95 % band (the
    report's scaling chart)."""
    vcpus = list(range(1, max(up_to, 1) + 1))
    shapes = [(max(1, -(-n // threads)), n) for n in vcpus]
    host = host_reading(curve, topology, run)
    central = fit_law(*medians(curve, "throughput_ips"), host).law
    rng = np.random.default_rng(SEED)
    lows, highs = [], []
    for _ in range(BOOTSTRAP):
        cores, values = medians(curve, "throughput_ips", rng)
        pess = fit_law(cores, values, host, SMT.pessimistic, CORES.pessimistic).law
        opt = fit_law(cores, values, host, SMT.optimistic, CORES.optimistic).law
        lows.append([pess(c, n) for c, n in shapes])
        highs.append([opt(c, n) for c, n in shapes])
    lo, hi = np.percentile(lows, 2.5, axis=0), np.percentile(highs, 97.5, axis=0)
    return vcpus, [central(c, n) for c, n in shapes], [float(v) for v in lo], [float(v) for v in hi]
