"""Classification figures from a confusion matrix (which is what processes all-reduce during evaluation)."""

from __future__ import annotations

import numpy as np


def confusion_figures(confusion: np.ndarray, class_names: list[str] | None = None) -> dict:
    """Accuracy, macro-F1 and per-class precision / recall / F1 / support.

    Args:
        confusion: (C, C) counts, rows = true class, columns = predicted class.
        class_names: C names (default: "0".."C-1").

    Returns:
        {"acc", "macro_f1", "per_class": {name: {"precision", "recall", "f1", "support"}}}. Macro-F1
        averages over the classes that occur in the split (support > 0) or are predicted: a class absent
        from both has no F1.
    """
    cm = np.asarray(confusion, dtype=np.float64)
    tp = np.diag(cm)
    support, predicted = cm.sum(1), cm.sum(0)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, support, out=np.zeros_like(tp), where=support > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    present = (support > 0) | (predicted > 0)
    names = class_names or [str(i) for i in range(len(cm))]
    total = cm.sum()
    return {
        "acc": float(tp.sum() / total) if total else 0.0,
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
        "per_class": {
            n: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(s)}
            for n, p, r, f, s in zip(names, precision, recall, f1, support, strict=True)
        },
    }
