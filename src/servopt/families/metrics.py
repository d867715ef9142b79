"""Quality figures every family shares (NumPy only): how closely outputs reproduce the original's."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from servopt.contracts import Agreement
from servopt.spec import OutputKind


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two batches (any trailing shape)."""
    a = a.reshape(len(a), -1).astype(np.float64)
    b = b.reshape(len(b), -1).astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)


def agreement(outputs: np.ndarray, reference: np.ndarray, task: str = "classification") -> Agreement:
    """Elementwise and cosine closeness on the same inputs; top-1 agreement (argmax's tie rule) for classifiers."""
    if outputs.shape != reference.shape:
        return Agreement(error=f"output shape {outputs.shape} differs from the reference {reference.shape}")
    diff = np.abs(outputs.astype(np.float64) - reference.astype(np.float64))
    cos = cosine(outputs, reference)
    out = Agreement(max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()), total=len(outputs),
                    cosine_min=float(cos.min()), cosine_mean=float(cos.mean()), cosine_p1=float(np.percentile(cos, 1)))
    if task == "classification":
        same = int((outputs.argmax(1) == reference.argmax(1)).sum())
        out.top1_agreement, out.agree = same / len(outputs), same
    return out


CONFIDENT = 0.5  # the original's top-1 probability above which it is "sure" of a sample
LEVEL = 0.95  # the confidence of every quality interval servopt reports


def probabilities(scores: np.ndarray, kind: OutputKind = "logits") -> np.ndarray:
    """Class probabilities (float64) from a classifier's outputs: a softmax of logits, the exp of log-probabilities,
    probabilities as they are (a softmax over probabilities would flatten them: a sure 0.99 read as 0.42 of 3)."""
    values = scores.reshape(len(scores), -1).astype(np.float64)
    if kind == "probabilities":
        return values
    if kind == "log-probabilities":
        return np.exp(values)
    values = np.exp(values - values.max(axis=1, keepdims=True))
    return values / values.sum(axis=1, keepdims=True)


def confident_mask(reference: np.ndarray, threshold: float = CONFIDENT, kind: OutputKind = "logits") -> np.ndarray:
    """Samples whose top-1 probability under the original's outputs (read as ``kind``) exceeds ``threshold``."""
    return probabilities(reference, kind).max(axis=1) > threshold


def split_agreement(agr: Agreement, outputs: np.ndarray, reference: np.ndarray, kind: OutputKind = "logits") -> Agreement:
    """Top-1 agreement where the original is sure (top-1 p > 0.5, its outputs read as ``kind``) and where it is not,
    with the counts: on samples the original itself hesitates over, a changed argmax says little about the variant
    (see docs/targets.md)."""
    same = outputs.argmax(1) == reference.argmax(1)
    sure = confident_mask(reference, kind=kind)
    agr.confident_total, agr.confident_agree = int(sure.sum()), int(same[sure].sum())
    agr.unsure_total, agr.unsure_agree = int((~sure).sum()), int(same[~sure].sum())
    agr.top1_agreement_confident = agr.confident_agree / agr.confident_total if agr.confident_total else None
    agr.top1_agreement_unsure = agr.unsure_agree / agr.unsure_total if agr.unsure_total else None
    return agr


@lru_cache(maxsize=8)
def _z(level: float) -> float:
    lo, hi = 0.0, 10.0  # the normal quantile by bisection on erf (no SciPy)
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erf(mid / math.sqrt(2)) < level else (lo, mid)
    return (lo + hi) / 2


def paired_drop_interval(lost: int, gained: int, total: int, level: float = LEVEL) -> tuple[float, float]:
    """The interval of the accuracy drop (a fraction, positive = the variant worse) on ``total`` paired samples:
    ``lost`` the original got right and the variant wrong, ``gained`` the reverse.

    Bonett and Price's adjusted Wald interval for paired proportions (2012): one added to each discordant count, two to
    the total, then Wald's. Why not the exact interval conditioned on the discordant samples: it is pinned to the
    disagreements seen (2 images lost of 368 gives +0.54 points as its upper end, the observed drop itself); nor a
    paired bootstrap: with no disagreement it has no width (nor has Newcombe's score interval at 50 % accuracy). Here 0
    changed of 368 still allows ±0.75 points, whatever the accuracy."""
    if total <= 0:
        return -1.0, 1.0
    n = total + 2
    p_lost, p_gained = (lost + 1) / n, (gained + 1) / n
    diff = p_lost - p_gained
    half = _z(level) * math.sqrt(max(0.0, p_lost + p_gained - diff * diff) / n)
    return max(-1.0, diff - half), min(1.0, diff + half)


def samples_to_settle(lost: int, gained: int, total: int, tolerance: float, level: float = LEVEL,
                      most: int = 10_000_000) -> int | None:
    """About how many paired samples, with the shares lost and gained seen here, would put the drop's interval wholly on
    one side of ``tolerance`` (a fraction); None when no count up to ``most`` would (a drop at the bound itself)."""
    if total <= 0:
        return None

    def settled(n: int) -> bool:
        low, high = paired_drop_interval(round(lost * n / total), round(gained * n / total), n, level)
        return high <= tolerance or low > tolerance

    if settled(total):
        return total
    hi = total
    while not settled(hi):
        hi *= 2
        if hi > most:
            return None
    lo = hi // 2
    while hi - lo > max(1, hi // 100):  # to 1 %: "about"
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if settled(mid) else (mid, hi)
    return hi


BOOTSTRAP_ROUNDS = 2000
BOOTSTRAP_SEED = 34


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share theirs), as Spearman's correlation takes them."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def paired_spearman_drop(reference: np.ndarray, variant: np.ndarray, gold: np.ndarray, level: float = LEVEL,
                         rounds: int = BOOTSTRAP_ROUNDS, seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """The interval of the Spearman drop (reference's minus the variant's correlation of similarity with ``gold``) by a
    seeded paired bootstrap over the pairs: both models are scored on the same resampled pairs, so what the two share
    (hard pairs, the scores' noise) cancels. Ranks are taken once on all pairs (a resample's duplicates keep theirs)."""
    ref, var, truth = (_ranks(np.asarray(a, dtype=np.float64)) for a in (reference, variant, gold))
    idx = np.random.default_rng(seed).integers(0, len(truth), (rounds, len(truth)))

    def corr(x: np.ndarray) -> np.ndarray:
        a, b = x[idx], truth[idx]
        a = a - a.mean(axis=1, keepdims=True)
        b = b - b.mean(axis=1, keepdims=True)
        denom = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
        return np.divide((a * b).sum(axis=1), denom, out=np.zeros(rounds), where=denom > 0)

    drops = corr(ref) - corr(var)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(drops, tail)), float(np.percentile(drops, 100 - tail))


def drop_note(drop: float, low: float, high: float, samples: int, tolerance: float, what: str = "samples",
              settle: Callable[[], int | None] | None = None) -> str:
    """How sure a drop (points) is, for a bound's note: its interval, and "unsure" with about how many ``what`` would
    settle it when the interval straddles ``tolerance``: ``settle()`` where the caller can recompute its interval at
    other counts, else from the interval's side narrowing as 1/√n (None: no count would, a drop at the bound)."""
    text = f"drop {drop:.2f} pt ({LEVEL:.0%} interval {low:.2f} … {high:.2f} on {samples} paired {what})"
    if not low <= tolerance < high:
        return text
    if settle is not None:
        need = settle()
    else:
        side, gap = (high - drop, tolerance - drop) if drop <= tolerance else (drop - low, drop - tolerance)
        need = math.ceil(samples * (side / gap) ** 2) if gap > 0 else None
    how = f"about {need:,} {what} like these would settle it" if need else f"no count of {what} settles a drop at the bound"
    return text + f"; unsure: the interval crosses the {tolerance:g}-point tolerance ({how})"
