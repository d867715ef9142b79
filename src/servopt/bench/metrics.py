"""Accuracy against labels and agreement against a reference model (NumPy only)."""

from __future__ import annotations

import numpy as np


def classification_accuracy(outputs: np.ndarray, labels: np.ndarray) -> dict:
    total = len(labels)
    order = np.argsort(-outputs, axis=1)
    top1 = int((order[:, 0] == labels).sum())
    k = min(5, outputs.shape[1])
    top5 = int((order[:, :k] == labels[:, None]).any(axis=1).sum())
    return {
        "top1": top1 / total if total else 0.0,
        "top5": top5 / total if total else 0.0,
        "correct": top1,
        "correct_top5": top5,
        "total": total,
    }


def format_accuracy(acc: dict | None) -> str:
    if not acc:
        return "n/a"
    return f"{acc['top1'] * 100:.2f}% ({acc['correct']}/{acc['total']} correct)"


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.reshape(len(a), -1).astype(np.float64)
    b = b.reshape(len(b), -1).astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)


def agreement(outputs: np.ndarray, reference: np.ndarray, task: str = "classification") -> dict:
    """How closely a variant reproduces the original model on the same inputs."""
    if outputs.shape != reference.shape:
        return {"error": f"output shape {outputs.shape} differs from the reference {reference.shape}"}
    diff = np.abs(outputs.astype(np.float64) - reference.astype(np.float64))
    out = {
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "total": len(outputs),
    }
    cos = _cosine(outputs, reference)
    out["cosine_min"] = float(cos.min())
    out["cosine_mean"] = float(cos.mean())
    if task == "classification":
        same = int((outputs.argmax(1) == reference.argmax(1)).sum())
        out["top1_agreement"] = same / len(outputs)
        out["agree"] = same
    return out
