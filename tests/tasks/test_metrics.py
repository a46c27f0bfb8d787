"""Classification figures from a confusion matrix, against hand-computed values and scikit-learn's."""

from __future__ import annotations

import numpy as np
import pytest

from mmfast.tasks.classification import confusion_figures


def test_figures_of_a_known_confusion_matrix():
    # "c" never occurs but is predicted twice (F1 0, averaged in); "d" neither occurs nor is predicted (left out)
    cm = np.array([[3, 1, 0, 0], [0, 2, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    f = confusion_figures(cm, ["a", "b", "c", "d"])
    assert f["acc"] == pytest.approx(5 / 8)
    a, b = f["per_class"]["a"], f["per_class"]["b"]
    assert (a["precision"], a["recall"], a["support"]) == (1.0, 0.75, 4)
    assert (b["precision"], b["recall"], b["support"]) == (pytest.approx(2 / 3), 0.5, 4)
    assert f["per_class"]["c"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}
    f1_a, f1_b = 2 * 0.75 / 1.75, 2 * (2 / 3) * 0.5 / (2 / 3 + 0.5)
    assert f["macro_f1"] == pytest.approx((f1_a + f1_b + 0.0) / 3)


def test_macro_f1_agrees_with_scikit_learn():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    truth, pred = rng.integers(0, 5, 300), rng.integers(0, 5, 300)
    pred[:150] = truth[:150]
    cm = np.zeros((5, 5), dtype=np.int64)
    np.add.at(cm, (truth, pred), 1)
    f = confusion_figures(cm)
    assert f["macro_f1"] == pytest.approx(sklearn_metrics.f1_score(truth, pred, average="macro"))
    assert f["acc"] == pytest.approx(sklearn_metrics.accuracy_score(truth, pred))
