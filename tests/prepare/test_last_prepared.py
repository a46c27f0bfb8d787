"""A preparation into a new folder keeps the image checks of the input's last preparation elsewhere (a second
run's raw --data, a new --out), as preparing again into the same folder does: unchanged images are not decoded
again, a changed one is, and the rows are those of a preparation that decoded everything. Real photos from
scikit-image, and shards written with the ``webdataset`` library's TarWriter."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image

from mmfast.data import validate
from mmfast.inputs import wds as wds_input
from mmfast.prepare.core import PrepareConfig, prepare_dataset
from mmfast.prepare.last_prepared import _REMEMBERED, LAST_PREPARED, last_prepared, remember, source_name

PHOTOS = ("rocket.jpg", "chelsea.png", "coffee.png", "astronaut.png", "motorcycle_left.png", "camera.png")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MMFAST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def manifest(tmp_path) -> Path:
    import skimage

    folder = tmp_path / "photos"
    folder.mkdir()
    rows = []
    for k, name in enumerate(PHOTOS * 2):
        im = Image.open(Path(skimage.data_dir) / name).convert("RGB").resize((96 + k, 64))
        im.save(folder / f"p{k}.jpg", "JPEG")
        rows.append({"image": f"p{k}.jpg", "text": f"photo {k}: the {name.split('.')[0]}", "label": name[:4]})
    path = folder / "captions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def decoded(monkeypatch) -> list[str]:
    """The image files ``check_images`` decodes from now on."""
    seen: list[str] = []
    real = validate.check_images

    def counted(paths, *args, **kwargs):
        seen.extend(Path(p).name for p in paths)
        return real(paths, *args, **kwargs)

    monkeypatch.setattr(validate, "check_images", counted)
    monkeypatch.setattr("mmfast.prepare.checks.check_images", counted)
    return seen


def _prepare(source: Path, out: Path) -> dict:
    return prepare_dataset(PrepareConfig(str(source), str(out), progress=False, workers=1, val_fraction=0.25))


def test_a_new_folder_keeps_the_last_preparations_checks(tmp_path, manifest, decoded, cache):
    first = tmp_path / "runs" / "a" / "prepared"
    _prepare(manifest, first)
    assert len(decoded) == 2 * len(PHOTOS)
    assert last_prepared(source_name(str(manifest)), tmp_path / "elsewhere") == first.resolve()
    changed = manifest.parent / "p3.jpg"
    Image.open(changed).rotate(90, expand=True).save(changed, "JPEG")  # another picture, another size
    decoded.clear()
    second = tmp_path / "runs" / "b" / "prepared"
    summary = _prepare(manifest, second)
    assert decoded == ["p3.jpg"] and summary["reused_checks"] == 2 * len(PHOTOS) - 1
    assert summary["reused_checks_from"] == str(first.resolve())  # what the command's summary names
    fresh = tmp_path / "fresh"
    shutil.rmtree(cache)  # nothing remembered: every image decoded
    decoded.clear()
    _prepare(manifest, fresh)
    assert len(decoded) == 2 * len(PHOTOS)
    for name in ("train.jsonl", "val.jsonl", "labels.json"):  # p3's new size included
        assert (second / name).read_bytes() == (fresh / name).read_bytes(), name


def test_a_stale_check_of_out_gives_way_to_the_other_folders(tmp_path, manifest, decoded):
    """a's check of p3 is stale once p3 changed and b checked it again: preparing into a then keeps b's."""
    _prepare(manifest, tmp_path / "a")
    changed = manifest.parent / "p3.jpg"
    Image.open(changed).rotate(90, expand=True).save(changed, "JPEG")
    _prepare(manifest, tmp_path / "b")
    decoded.clear()
    assert _prepare(manifest, tmp_path / "a")["reused_checks"] == 2 * len(PHOTOS) and decoded == []


def test_a_removed_or_reused_folder_is_not_trusted(tmp_path, manifest, decoded):
    first, second = tmp_path / "a", tmp_path / "b"
    _prepare(manifest, first)
    shutil.rmtree(first)
    decoded.clear()
    assert _prepare(manifest, second)["reused_checks"] == 0 and len(decoded) == 2 * len(PHOTOS)
    other = manifest.parent / "other.jsonl"  # another input prepared into the folder the entry names
    other.write_text(manifest.read_text())
    _prepare(other, second)
    assert last_prepared(source_name(str(manifest)), tmp_path / "c") is None


def test_shards_read_for_one_folder_are_not_read_for_another(tmp_path, monkeypatch):
    wds = pytest.importorskip("webdataset")
    import skimage

    folder = tmp_path / "shards"
    folder.mkdir()
    for k in range(2):
        with wds.TarWriter(str(folder / f"{k:05d}.tar")) as w:
            for j, name in enumerate(PHOTOS):
                im = Image.open(Path(skimage.data_dir) / name).convert("RGB").resize((64, 48))
                path = tmp_path / "one.jpg"
                im.save(path, "JPEG")
                w.write({"__key__": f"{k}{j:03d}", "jpg": path.read_bytes(), "txt": f"{name} {k}", "cls": str(j)})
    _prepare(folder, tmp_path / "a")
    opened: list[str] = []
    real = wds_input.read_shard
    monkeypatch.setattr(
        wds_input, "read_shard", lambda shard, *a, **kw: opened.append(shard) or real(shard, *a, **kw)
    )
    assert _prepare(folder, tmp_path / "b")["reused_checks"] == 2 * len(PHOTOS) and opened == []
    tar = folder / "00000.tar"
    os.utime(tar, ns=(tar.stat().st_atime_ns, tar.stat().st_mtime_ns + 10**9))
    _prepare(folder, tmp_path / "b")
    assert [Path(s).name for s in opened] == ["00000.tar"]
    opened.clear()  # a's own record of shard 0 is stale now, b's is not: b's serves
    assert _prepare(folder, tmp_path / "a")["reused_checks"] == 2 * len(PHOTOS) and opened == []


def test_only_so_many_inputs_are_remembered(tmp_path, cache):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "prepare.json").write_text(json.dumps({"source": "/data/kept"}))
    remember("/data/kept", kept)
    for k in range(_REMEMBERED + 5):  # folders that are gone
        remember(f"/data/{k}", tmp_path / f"gone{k}")
    entries = list((cache / LAST_PREPARED).glob("*.json"))
    assert len(entries) <= _REMEMBERED and last_prepared("/data/kept", tmp_path / "new") == kept
    assert not [p for p in entries if os.path.getsize(p) == 0]
