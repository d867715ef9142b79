"""Quality figures every family shares (NumPy only): how closely outputs reproduce the original's."""

from __future__ import annotations

import numpy as np

from servopt.contracts import Agreement


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
