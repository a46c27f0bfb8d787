"""tools/experiments/compare_fusion.py end to end on the small demo set: every model and seed trains on one
split, the TF-IDF caption baseline sits in the same table, and the figures in the JSON are the runs' own."""

from __future__ import annotations

import json

import pytest

from tools.experiments import compare_fusion


@pytest.mark.slow
def test_compare_fusion_table_json_and_chart(prepared, tmp_path, capsys):
    pytest.importorskip("sklearn")
    out = tmp_path / "cmp"
    argv = [
        "--data",
        str(prepared),
        "--preset",
        "tiny",
        "--models",
        "text",
        "concat",
        "--seeds",
        "0",
        "1",
        "--epochs",
        "1",
        "--out",
        str(out),
    ]
    assert compare_fusion.main(argv) == 0
    report = json.loads((out / "compare.json").read_text())
    rows = {r["model"]: r for r in report["rows"]}
    assert set(rows) == {"text", "concat", "tfidf+logreg (captions)"}
    for model in ("text", "concat"):
        runs = report["runs"][model]
        assert [r["model"] for r in runs] == [model, model] and rows[model]["seeds"] == 2
        assert rows[model]["val_acc"] == pytest.approx(sum(r["val_acc"] for r in runs) / 2)
    # the demo captions carry only the attribute (2 of 10 classes' information): a caption classifier caps at 0.2
    assert 0.1 <= rows["tfidf+logreg (captions)"]["val_acc"] <= 0.3
    assert (out / "compare.png").stat().st_size > 1000
    assert "tfidf+logreg (captions)" in capsys.readouterr().out
