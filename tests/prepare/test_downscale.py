"""prepare --max-side: copies no larger than N, showing what the decoder showed, read by the loaders."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import write_jsonl
from PIL import Image

from mmfast.data.dataset import PreparedDataset
from mmfast.loading.multimodal import MultimodalLoader
from mmfast.prepare.core import PrepareConfig, prepare_dataset

MAX_SIDE = 200


def _rows(prepared: Path, split: str) -> list[dict]:
    return PreparedDataset(prepared).rows(split)  # a copy's path made absolute (the file names it relatively)


@pytest.fixture
def photo_manifest(photos, tmp_path) -> Path:
    """Real photos (JPEG and PNG, RGB and RGBA, 300-640 px), a small one, and a JPEG stored sideways with an
    EXIF orientation tag (6: rotate 90 degrees clockwise to display)."""
    img = tmp_path / "user" / "img"
    img.mkdir(parents=True)
    names = []
    for p in photos:
        shutil.copy(p, img / p.name)
        names.append(p.name)
    Image.open(photos[0]).convert("RGB").resize((120, 90)).save(img / "small.jpg", quality=95)
    names.append("small.jpg")
    upright = Image.open(photos[0]).convert("RGB").resize((300, 400))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    upright.transpose(Image.Transpose.ROTATE_90).save(img / "sideways.jpg", quality=95, exif=exif.tobytes())
    upright.save(tmp_path / "upright.png")  # the reference: what a viewer (and DALI) shows
    names.append("sideways.jpg")
    rows = [{"image": f"img/{n}", "text": f"photo {n}", "label": i % 2} for i, n in enumerate(names)]
    write_jsonl(tmp_path / "user" / "manifest.jsonl", rows)
    return tmp_path / "user" / "manifest.jsonl"


def test_copies_are_no_larger_than_max_side_and_show_what_the_original_shows(photo_manifest, tmp_path):
    user_files = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in photo_manifest.parent.rglob("*")
                  if p.is_file()}  # fmt: skip
    out = tmp_path / "prepared"
    summary = prepare_dataset(
        PrepareConfig(source=str(photo_manifest), out=str(out), val_fraction=0, max_side=MAX_SIDE, progress=False)
    )
    rows = {Path(r.get("original", r["image"])).name: r for r in _rows(out, "train")}
    assert len(rows) == len(user_files) - 1  # every image (the manifest is the other file)
    assert summary["counts"]["downscaled"] == len(rows) - 1  # all but the small one
    assert rows["small.jpg"]["image"].endswith("img/small.jpg") and "original" not in rows["small.jpg"]
    raw = [json.loads(ln)["image"] for ln in (out / "train.jsonl").read_text().splitlines()]
    assert sum(r.startswith("downscaled/") for r in raw) == len(rows) - 1  # relative: the directory can move
    for name, r in rows.items():
        if name == "small.jpg":
            continue
        copy, original = Path(r["image"]), Path(r["original"])
        assert copy.parent.parent == out / "downscaled" and original.name == name
        with Image.open(copy) as c:
            assert c.format == "JPEG" and max(c.size) == MAX_SIDE, (name, c.size)
            got = np.asarray(c.convert("RGB"), dtype=np.float32)
        ref = Image.open(original)
        if name == "sideways.jpg":
            ref = Image.open(tmp_path / "upright.png")  # orientation applied: upright, 150x200
            assert got.shape[:2] == (MAX_SIDE, 150)
        ref = np.asarray(ref.convert("RGB").resize(got.shape[1::-1], Image.LANCZOS), dtype=np.float32)
        assert np.abs(got - ref).mean() < 4.0, name  # JPEG q90 + filters: a few 8-bit levels
    # the user's files are as they were
    for p, (mtime, data) in user_files.items():
        assert p.stat().st_mtime_ns == mtime and p.read_bytes() == data


def test_loader_reads_the_copies_with_the_originals_gone_and_settings_change_the_preparation(
    photo_manifest, tmp_path
):
    out = tmp_path / "prepared"
    cfg = PrepareConfig(
        source=str(photo_manifest), out=str(out), val_fraction=0, max_side=MAX_SIDE, progress=False
    )
    first = prepare_dataset(cfg)
    assert prepare_dataset(cfg)["timings_s"] == first["timings_s"]  # same settings: reused as it is
    moved = tmp_path / "moved"
    os.rename(photo_manifest.parent / "img", moved)  # the originals are gone, except the small one
    (photo_manifest.parent / "img").mkdir()
    shutil.copy2(moved / "small.jpg", photo_manifest.parent / "img" / "small.jpg")
    elsewhere = tmp_path / "elsewhere" / "prepared"  # and the prepared directory itself moved
    elsewhere.parent.mkdir()
    os.rename(out, elsewhere)
    loader = MultimodalLoader(elsewhere, "train", batch_size=4, size=64, drop_last=False, shuffle=True)
    ids = []
    for batch in loader:
        assert batch["image"].shape[1:] == (3, 64, 64) and np.isfinite(batch["image"].float().numpy()).all()
        ids += batch["id"].tolist()
    assert sorted(ids) == [r["id"] for r in _rows(elsewhere, "train")] and not loader.skipped
    os.rename(photo_manifest.parent / "img", tmp_path / "partial")
    os.rename(moved, photo_manifest.parent / "img")
    again = prepare_dataset(PrepareConfig(**{**cfg.__dict__, "max_side": 300}))  # another size: prepared again
    assert again["timings_s"] != first["timings_s"]
    assert all(max(Image.open(r["image"]).size) <= 300 for r in _rows(out, "train"))


def test_copies_record_the_size_dali_decodes_so_the_loader_draws_on_the_host(photo_manifest, tmp_path):
    """Every row, copies included, records the size DALI's decoder gives its file (the sideways JPEG's copy
    upright), so the loader draws the crop windows on the host for the whole split."""
    from mmfast.data.validate import dali_rejects

    out = tmp_path / "prepared"
    prepare_dataset(
        PrepareConfig(source=str(photo_manifest), out=str(out), val_fraction=0, max_side=MAX_SIDE, progress=False)
    )
    rows = _rows(out, "train")
    assert sum("original" in r for r in rows) == len(rows) - 1
    shapes: dict[int, tuple[int, int]] = {}
    assert dali_rejects([r["image"] for r in rows], 1, shapes=shapes) == {}
    assert [tuple(r.get("decoded_shape", ())) for r in rows] == [shapes[i] for i in range(len(rows))]
    sideways = next(r for r in rows if r.get("original", "").endswith("sideways.jpg"))
    assert sideways["decoded_shape"] == [MAX_SIDE, 150]
    table = PreparedDataset(out).table("train")
    loader = MultimodalLoader(out, "train", 4, size=32, train=True, num_workers=1)
    assert table.decoded_shapes is not None and np.array_equal(loader.images.image_sizes, table.decoded_shapes)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="--max-side"):
        PrepareConfig(source="x", out="y", max_side=8)
    with pytest.raises(ValueError, match="--quality"):
        PrepareConfig(source="x", out="y", max_side=256, quality=0)
