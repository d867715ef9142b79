"""What a projected figure's band holds beyond the scaling rounds' noise: the served capacity's spread from one search to
the next, and the CPU change where the figures could not be held to the target's instruction set.

Both vary more than the rounds do, and both used to be left out of the band (issue 42): the same text pick gave 667,
824 and 980 requests/s in three capacity searches on one machine, and ONNX Runtime cannot be held to an AVX2 target's
kernels on a VNNI machine. The instances a stated load needs are counted at the band's low end, so a band without them
under-provisions. Each is an ``Allowance``: factors of the central figure the band's two ends are multiplied by, measured
where the run has the figures (three or more searches are drawn from as they are: ``scaling.Served``), else stated
with where the figures come from. Pure functions of the stored results, like ``decide``.
"""

from __future__ import annotations

import numpy as np

from servopt.contracts import Allowance, Capacity, Environment, Record
from servopt.cpu import CpuFeatures, Isa, richer

# One capacity search's spread, where it was not repeated: any search may fall at either end of what the next ones
# find, so one stands for the next within the widest ratio repeated searches of one pick showed. Seven searches of the
# text demo's pick on one shared Zen 4 (the same server configuration and requests, minutes apart, 2026-11-29,
# docs/serving.md) gave 363.6-560.8 requests/s (1.54x); three on a shared Xeon gave 666.9-979.5 (1.47x, runs 7-9).
# A machine's speed moves between searches; one search cannot see it.
SEARCH_RATIO = 1.55
SEARCH_SOURCE = ("one search stands for the next within ×0.65–1.55: seven searches of one pick gave 364–561 requests/s on "
                 "a shared Zen 4, three 667–980 on a shared Xeon (docs/serving.md)")
# ONNX Runtime's U8S8 product kernel without VNNI runs at 63-80 GMAC/s on one thread of an AVX2-only Zen 4, against 198
# with AVX512-VNNI on the same CPU model (docs/benchmarks.md, "Where a 128-token call's time goes"): an INT8 model whose
# time is in its products keeps about a third of its speed on a target without 8-bit dot products.
INT8_WITHOUT_VNNI = 0.32
# oneDNN held to AVX2 on an AVX-512 Zen 4 kept 0.89-0.94 of its batch throughput (docs/benchmarks.md, "Standing in for
# an AVX2 target"), less the comparison's noise (its uncappable control moved 3 %).
FP_WITHOUT_AVX512 = 0.85


def served_figures(capacities: list[Capacity]) -> tuple[float, ...]:
    """Samples/s of each search of one variant that found a capacity (0 is kept: nothing met the SLO)."""
    return tuple(c.capacity_rps * c.batch_size for c in capacities if c.error is None)


def served_spread(capacities: list[Capacity]) -> Allowance | None:
    """The served figure's spread where it cannot be drawn from three or more searches: a stated ``SEARCH_RATIO``
    either way of their median, widened to their own extremes and to any rate a valid step missed below it (a search that
    failed a rate under the capacity it confirmed saw the server sustain less for a while). None where three or more
    searches are drawn from (``scaling.Served``) or nothing was served."""
    figures = served_figures(capacities)
    if len(figures) >= 3 or not figures or max(figures) <= 0:
        return None
    central = float(np.median(figures))
    per_request = {c.batch_size for c in capacities} == {1}
    missed = [s.rate_rps * c.batch_size for c in capacities for s in c.steps
              if s.valid and not s.meets and s.rate_rps * c.batch_size < central]
    low = min([1 / SEARCH_RATIO, min(figures) / central, *(m / central for m in missed)])
    high = max(SEARCH_RATIO, max(figures) / central)
    seen = f"; a step missed at {min(missed):,.0f}/s" if missed else ""
    searches = f"{len(figures)} searches ({', '.join(f'{f:,.0f}' for f in figures)})" if len(figures) > 1 else "one search"
    return Allowance(what="served", low=low, high=high, measured=False, words=(
        f"served capacity from {searches}{seen}: ×{low:.2f}–{high:.2f} ({SEARCH_SOURCE})"
        + ("" if per_request else "; in samples/s")))


def held_to(env: Environment | None, runtime_cappable: bool, target_isa: Isa | str | None) -> bool:
    """Whether figures taken in ``env`` ran with no richer instruction set than the target's: the host has none
    richer, or the runtime was capped (``Runtime.isa_cap_env``) and the figures say so (``Environment.isa_cap``)."""
    if target_isa is None or env is None:
        return True
    return not richer(env.isa, target_isa) or (runtime_cappable and env.isa_cap is not None)


def cpu_change(rec: Record, env: Environment | None, held: bool, target_isa: Isa | str | None) -> Allowance | None:
    """The CPU change where the figures could not be held to the target's instruction set (``held``): what the richer
    rungs of the host's ladder the target lacks can take from them — INT8 products without 8-bit dot products
    (``INT8_WITHOUT_VNNI``), the rest without AVX-512 (``FP_WITHOUT_AVX512``). The band's low end only: the target's
    poorer kernels are never faster."""
    if held or target_isa is None or env is None:
        return None
    host = CpuFeatures(frozenset(env.cpu_flags))
    session = rec.environment.session if rec.environment else None
    int8 = session is not None and "int8" in {session.precision_actual, session.precision_requested}
    target = Isa(target_isa)
    if int8 and host.int8_dot and target < Isa.AVX512_VNNI:
        low, why = INT8_WITHOUT_VNNI, ("its INT8 products ran with 8-bit dot products (VNNI) the target lacks: ONNX "
                                       "Runtime's U8S8 kernel runs at 63-80 GMAC/s without them against 198 with them "
                                       "on one Zen 4 core (docs/benchmarks.md)")
    elif richer(host.level, target):
        low, why = FP_WITHOUT_AVX512, (f"it ran with {host.level} kernels the target's {target} lacks: oneDNN held to "
                                       "AVX2 kept 0.89-0.94 of its batch throughput on an AVX-512 Zen 4 (docs/benchmarks.md)")
    else:
        return None
    return Allowance(what="cpu", low=low, high=1.0, measured=False,
                     words=f"CPU change ×{low:g}–1 ({rec.runtime} could not be held to {target} here; {why})")
