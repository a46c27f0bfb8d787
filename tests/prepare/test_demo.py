"""The demo dataset needs both modalities: checked from the generator's definition and its output."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import numpy as np

from mmfast import demo


def test_single_modality_ceilings_from_the_generator():
    c = demo.single_modality_ceilings()
    assert c == {"image_only": 0.5, "text_only": 0.2, "both": 1.0}


def test_image_depends_only_on_shape_and_caption_only_on_attribute():
    for seed in range(5):
        a = demo.render_shape("triangle", seed)
        assert np.array_equal(a, demo.render_shape("triangle", seed))  # no hidden state: attribute can't leak
        assert not np.array_equal(a, demo.render_shape("square", seed))
        cap = demo.make_caption("morning", seed)
        assert not any(s in cap for s in demo.SHAPES)
        assert not any(w in cap for w in demo._ATTR_WORDS["evening"])


def test_generated_rows_meet_the_ceilings(demo_manifest):
    rows = [json.loads(ln) for ln in demo_manifest.read_text().splitlines()]
    assert len(rows) == 300 and len({r["label"] for r in rows}) == 10
    # Best accuracy of a classifier that sees only the shape (image) or only the attribute (caption):
    by_shape, by_attr = defaultdict(Counter), defaultdict(Counter)
    for r in rows:
        by_shape[r["shape"]][r["label"]] += 1
        by_attr[r["attribute"]][r["label"]] += 1
    img_only = sum(c.most_common(1)[0][1] for c in by_shape.values()) / len(rows)
    txt_only = sum(c.most_common(1)[0][1] for c in by_attr.values()) / len(rows)
    assert img_only <= 0.6 and txt_only <= 0.3  # 0.5 and 0.2 in expectation, sampling noise on 300 rows
    assert all(r["label"] == demo.label_name(r["shape"], r["attribute"]) for r in rows)
    for r in rows:
        assert not any(s in r["text"] for s in demo.SHAPES)


def test_generation_is_deterministic(tmp_path):
    a = demo.demo_dataset(n=200, seed=3, root=tmp_path / "a")
    b = demo.demo_dataset(n=200, seed=3, root=tmp_path / "b")
    assert a.read_text() == b.read_text()
    assert (a.parent / "images" / "00007.jpg").read_bytes() == (b.parent / "images" / "00007.jpg").read_bytes()
