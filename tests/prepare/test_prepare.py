"""Manifest reading, image validation and tools/prepare_data.py end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT, save_image, write_jsonl

from mmfast.data.validate import check_image, check_images
from mmfast.inputs.manifest import ManifestError, read_input
from mmfast.prepare.core import PrepareConfig, prepare_dataset
from tools import prepare_data


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


@pytest.fixture
def bad_dataset(tmp_path):
    """Good images of every accepted format plus one row for every kind of bad input."""
    img = tmp_path / "img"
    good = {
        "rgb.jpg": save_image(img / "rgb.jpg", seed=1),
        "rgba.png": save_image(img / "rgba.png", mode="RGBA", seed=2),
        "gray.png": save_image(img / "gray.png", mode="L", seed=3),
        "cmyk.jpg": save_image(img / "cmyk.jpg", mode="CMYK", fmt="JPEG", seed=4),
        "pic.bmp": save_image(img / "pic.bmp", seed=5),
        "pic.tif": save_image(img / "pic.tif", seed=6),
        "pic.webp": save_image(img / "pic.webp", seed=7),
        "gray.jpg": save_image(img / "gray.jpg", mode="L", seed=8),
    }
    full = (img / "rgb.jpg").read_bytes()
    (img / "truncated.jpg").write_bytes(full[: len(full) // 2])
    (img / "zero.jpg").write_bytes(b"")
    (img / "text.jpg").write_bytes(b"this is not an image at all\n" * 10)
    (img / "a_dir.jpg").mkdir()
    save_image(img / "anim.gif", fmt="GIF")
    rows = [
        {"image": f"img/{n}", "text": f"caption {i}", "label": "cat" if i % 2 else "dog"}
        for i, n in enumerate(good)
    ]
    bad = [
        ({"image": "img/missing.jpg", "text": "x", "label": "cat"}, f"missing file: {img / 'missing.jpg'}"),
        ({"image": "https://example.com/a.jpg", "text": "x", "label": "cat"}, "is a URL; mmfast reads local"),
        ({"image": "img/truncated.jpg", "text": "x", "label": "cat"}, "truncated"),
        ({"image": "img/zero.jpg", "text": "x", "label": "cat"}, "zero size"),
        ({"image": "img/text.jpg", "text": "x", "label": "cat"}, "not an image"),
        ({"image": "img/a_dir.jpg", "text": "x", "label": "cat"}, "directory"),
        ({"image": "img/anim.gif", "text": "x", "label": "cat"}, "unsupported image format GIF"),
        ({"image": "img/rgb.jpg", "text": "   ", "label": "cat"}, "empty text"),
        ({"image": "img/rgb.jpg", "label": "cat"}, "missing field 'text'"),
        ({"image": "img/rgb.jpg", "text": "y", "label": [1]}, "unknown label type"),
        ({"image": "img/rgb.jpg", "text": "y", "label": 3}, "mixed label types"),
        ({"image": "img/rgb.jpg", "text": "caption 0", "label": "dog"}, "duplicate of line 1"),
        ('{"image": "img/rgb.jpg", "text": "oops"', "invalid JSON"),
        ("[1, 2]", "expected an object"),
    ]
    lines = [json.dumps(r) for r in rows] + [r if isinstance(r, str) else json.dumps(r) for r, _ in bad]
    raw = (
        "\r\n".join(lines).encode() + b"\r\n" + b'{"image": "img/rgb.jpg", "text": "caf\xe9", "label": "cat"}\r\n'
    )
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(b"\xef\xbb\xbf" + raw)  # a BOM and CRLF line ends, as Windows tools write them
    expected = {len(rows) + i + 1: reason for i, (_, reason) in enumerate(bad)}
    expected[len(lines) + 1] = "not UTF-8"
    return manifest, len(rows), expected


def test_every_bad_input_is_rejected_with_its_reason_and_good_rows_survive(bad_dataset, tmp_path):
    manifest, n_good, expected = bad_dataset
    out = tmp_path / "out"
    summary = prepare_dataset(PrepareConfig(source=str(manifest), out=str(out), progress=False, workers=2))
    rejected = {r["line"]: r["reason"] for r in _read_jsonl(out / "rejected.jsonl")}
    assert set(rejected) == set(expected)
    for line, reason in expected.items():
        assert reason in rejected[line], (line, rejected[line])
    kept = _read_jsonl(out / "train.jsonl") + _read_jsonl(out / "val.jsonl")
    assert sorted(r["line"] for r in kept) == list(range(1, n_good + 1))
    c = summary["counts"]
    assert c["input_rows"] == n_good + len(expected) == c["accepted"] + c["rejected"]
    assert c["accepted"] == c["train"] + c["val"] == n_good


def test_validation_reasons_single_files(tmp_path):
    ok = save_image(tmp_path / "ok.png", mode="RGBA")
    assert check_image(str(ok)).ok and check_image(str(ok)).format == "PNG"
    loop = tmp_path / "loop.jpg"
    os.symlink(loop, loop)
    assert check_image(str(loop)).reason == "symlink loop"
    assert "not a regular file" in check_image("/dev/null").reason
    # A JPEG whose tail is cut: PIL and DALI must both refuse it, and the reason must say so.
    full = save_image(tmp_path / "big.jpg", size=(300, 200)).read_bytes()
    (tmp_path / "cut.jpg").write_bytes(full[:-400])
    res = check_images([str(tmp_path / "cut.jpg"), str(ok)], workers=1)
    assert not res[0].ok and "truncated" in res[0].reason
    assert res[1].ok


def test_csv_and_folder_inputs(tmp_path):
    save_image(tmp_path / "a.jpg")
    (tmp_path / "m.csv").write_text(
        'image,text,label,extra\na.jpg,"hello, world",3,x\na.jpg,second,4,y\na.jpg,third\n'
    )
    cands, rejects, kind = read_input(tmp_path / "m.csv")
    assert kind == "csv" and [c.label for c in cands] == [3, 4] and cands[0].text == "hello, world"
    assert [(r.line, r.reason) for r in rejects] == [(4, "missing field 'label'")]

    root = tmp_path / "folder"
    save_image(root / "cat" / "1.jpg")
    save_image(root / "dog" / "2.png")
    (root / "dog" / "2.png.txt").write_text("a dog on grass\n")
    (root / "cat" / "notes.md").write_text("not an image")
    cands, rejects, kind = read_input(root)
    assert kind == "folder"
    assert [(Path(c.image).name, c.text, c.label) for c in cands] == [
        ("1.jpg", "cat", "cat"),
        ("2.png", "a dog on grass", "dog"),
    ]
    assert len(rejects) == 1 and "not an image file name" in rejects[0].reason
    # named by a relative path, the folder's rows still name files that open from anywhere (they were
    # relative to where mmfast-prepare ran, so training looked for them inside the prepared directory)
    here = Path.cwd()
    try:
        os.chdir(tmp_path)
        cands, _, _ = read_input(Path("folder"))
    finally:
        os.chdir(here)
    assert [c.image for c in cands] == [
        str((root / "cat" / "1.jpg").resolve()),
        str((root / "dog" / "2.png").resolve()),
    ]


def test_confine_rejects_paths_outside_the_manifest_folder(tmp_path):
    save_image(tmp_path / "outside.jpg")
    inner = tmp_path / "inner"
    inner.mkdir()
    save_image(inner / "in.jpg")
    m = write_jsonl(
        inner / "m.jsonl",
        [
            {"image": "../outside.jpg", "text": "a", "label": "x"},
            {"image": str(tmp_path / "outside.jpg"), "text": "b", "label": "x"},
            {"image": "in.jpg", "text": "c", "label": "x"},
        ],
    )
    cands, rejects, _ = read_input(m)
    assert len(cands) == 3 and not rejects  # absolute paths and .. are legal by default
    cands, rejects, _ = read_input(m, confine=True)
    assert [c.text for c in cands] == ["c"] and all("confined" in r.reason for r in rejects)


def test_split_is_seeded_stratified_and_ids_are_contiguous(prepared, demo_manifest, tmp_path):
    train, val = _read_jsonl(prepared / "train.jsonl"), _read_jsonl(prepared / "val.jsonl")
    assert [r["id"] for r in train + val] == list(range(300))
    labels = json.loads((prepared / "labels.json").read_text())
    assert labels == {n: i for i, n in enumerate(sorted(labels))} and len(labels) == 10
    assert 35 <= len(val) <= 85  # 20% of 300 by a hash of each image: 60 expected, 3 sigma either side
    for idx in labels.values():  # every class is trained on and evaluated on
        assert any(r["label"] == idx for r in val) and any(r["label"] == idx for r in train)
    again = tmp_path / "again"
    prepare_dataset(PrepareConfig(source=str(demo_manifest), out=str(again), max_length=32, progress=False))
    assert _read_jsonl(again / "val.jsonl") == val
    other = tmp_path / "other"
    prepare_dataset(
        PrepareConfig(source=str(demo_manifest), out=str(other), max_length=32, seed=5, progress=False)
    )
    assert [r["line"] for r in _read_jsonl(other / "val.jsonl")] != [r["line"] for r in val]


def _sides(out: Path) -> dict[str, set[str]]:
    """{image file name: the splits its rows are in}."""
    sides: dict[str, set[str]] = {}
    for split in ("train", "val"):
        for r in _read_jsonl(out / f"{split}.jsonl"):
            sides.setdefault(Path(r["image"]).name, set()).add(split)
    return sides


def test_split_keeps_an_image_on_one_side_and_rows_in_place_when_rows_are_added(tmp_path):
    """Several captions of one picture (COCO-style) never straddle the split; adding pictures and preparing
    again moves no earlier picture across it; the dataset moved elsewhere keeps its split."""
    data = tmp_path / "data"
    for i in range(90):
        save_image(data / f"p{i}.jpg", size=(16, 16), seed=i)
    rows = [
        {"image": f"p{i}.jpg", "text": f"picture {i}, caption {c}", "label": f"class{i % 3}"}
        for i in range(60)
        for c in range(4)
    ]
    m = write_jsonl(data / "m.jsonl", rows)
    cfg = PrepareConfig(source=str(m), out=str(tmp_path / "p"), val_fraction=0.3, progress=False)
    prepare_dataset(cfg)
    first = _sides(tmp_path / "p")
    assert len(first) == 60 and all(len(s) == 1 for s in first.values())
    assert 8 <= sum(s == {"val"} for s in first.values()) <= 30  # 18 expected
    write_jsonl(
        m, rows + [{"image": f"p{i}.jpg", "text": f"new {i}", "label": f"class{i % 3}"} for i in range(60, 90)]
    )
    prepare_dataset(cfg)
    grown = _sides(tmp_path / "p")
    assert len(grown) == 90 and all(grown[name] == side for name, side in first.items())
    moved = tmp_path / "moved"
    data.rename(moved)
    prepare_dataset(replace(cfg, source=str(moved / "m.jsonl"), out=str(tmp_path / "q")))
    assert _sides(tmp_path / "q") == grown


def test_the_trained_vocabulary_is_the_same_in_every_process(tmp_path):
    """Two preparations of one input in two fresh processes (another hash-map order each) write the same
    tokenizer and token ids: the WordPiece trainer's continuing pieces are numbered beforehand."""
    import skimage

    rows = []
    for i, line in enumerate(Path(skimage.__file__).with_name("__init__.py").read_text().splitlines()[:400]):
        if line.strip():
            rows.append({"image": "a.png", "text": f"{line.strip()[:80]} {i}", "label": "ab"[i % 2]})
    save_image(tmp_path / "a.png")
    m = write_jsonl(tmp_path / "m.jsonl", rows)
    outs = []
    for k in range(2):
        out = tmp_path / f"p{k}"
        cmd = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), str(m), "--out", str(out), "--no-progress"]
        subprocess.run([*cmd, "--vocab-size", "300", "--val-fraction", "0"], check=True, capture_output=True)
        outs.append(out)
    for name in ("tokenizer/tokenizer.json", "tokens/train.ids.bin", "tokens/train.meta.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_prepare_reuses_an_up_to_date_directory(demo_manifest, tmp_path):
    cfg = PrepareConfig(source=str(demo_manifest), out=str(tmp_path / "p"), max_length=32, progress=False)
    first = prepare_dataset(cfg)
    stamp = (tmp_path / "p" / "train.jsonl").stat().st_mtime_ns
    second = prepare_dataset(cfg)
    assert second == first and (tmp_path / "p" / "train.jsonl").stat().st_mtime_ns == stamp


def test_tool_exit_codes_and_messages(tmp_path, capsys, demo_manifest):
    assert prepare_data.main([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "no such manifest" in capsys.readouterr().err
    m = write_jsonl(tmp_path / "bad.jsonl", [{"image": "missing.jpg", "text": "t", "label": "a"}])
    assert prepare_data.main([str(m), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no usable rows out of 1" in err and "missing file" in err and str(m) in err
    assert not (tmp_path / "o").exists()  # nothing half-written
    # image-text pairs without a label: the message says how to prepare them
    image = json.loads(demo_manifest.read_text().splitlines()[0])["image"]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"image": image, "text": "a"}, {"image": image, "text": "b"}])
    assert prepare_data.main([str(pairs), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "missing field 'label'" in (err := capsys.readouterr().err) and "pass --no-labels" in err, err
    csv_pairs = tmp_path / "pairs.csv"
    csv_pairs.write_text(f"image,text\n{image},a\n")
    assert prepare_data.main([str(csv_pairs), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "lacks ['label']" in (err := capsys.readouterr().err) and "--no-labels" in err, err
    (tmp_path / "x.txt").write_text("image,text\n")
    assert prepare_data.main([str(tmp_path / "x.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "unknown manifest format" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare_data.main([str(demo_manifest), "--out", str(tmp_path / "o"), "--val-fraction", "abc"])
    assert prepare_data.main([str(demo_manifest), "--out", str(tmp_path / "o"), "--val-fraction", "1.5"]) == 2
    assert "--val-fraction" in capsys.readouterr().err
    assert (
        prepare_data.main([str(demo_manifest), "--out", str(tmp_path / "ok"), "--no-progress", "--format", "wds"])
        == 0
    )
    assert "accepted" in capsys.readouterr().out
    index = json.loads((tmp_path / "ok" / "wds" / "train.json").read_text())
    n_train = len((tmp_path / "ok" / "train.jsonl").read_text().splitlines())
    assert index["samples"] == n_train and all(
        (tmp_path / "ok" / "wds" / f"{s}.idx").is_file() for s in index["shards"]
    )


def test_real_photos_and_non_ascii_captions(photos, tmp_path):
    rows = [
        {"image": str(p), "text": t, "label": p.suffix[1:]}
        for p, t in zip(
            photos,
            [
                "fusée au décollage",
                "深宇宙の銀河",
                "глазное дно",
                "a cat 🐱",
                "astronaut in orbit",
                "café au lait",
            ],
            strict=False,
        )
    ]
    m = write_jsonl(tmp_path / "m.jsonl", rows)
    summary = prepare_dataset(PrepareConfig(source=str(m), out=str(tmp_path / "o"), progress=False))
    assert summary["counts"]["accepted"] == len(photos) and summary["counts"]["rejected"] == 0


def test_manifest_that_cannot_be_read(tmp_path):
    with pytest.raises(ManifestError, match="lacks"):
        read_input(write_jsonl(tmp_path / "m.csv", ["image,caption", "a.jpg,x"]))
