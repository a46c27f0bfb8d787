"""Preparing shards again after one changed reads only that shard: the others' rows and rejects come from the
records the last preparation kept (``inputs.file_reads``), and the result is the one a fresh preparation gives.
Shards written with the ``webdataset`` library's TarWriter from scikit-image's photos."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from PIL import Image

from mmfast.inputs import InputOptions, file_reads
from mmfast.inputs import wds as wds_input
from mmfast.inputs.file_reads import FILE_READS, load_all
from mmfast.inputs.manifest import NO_LABEL
from mmfast.prepare.core import PrepareConfig, prepare_dataset
from mmfast.prepare.parts import part_dir

wds = pytest.importorskip("webdataset")
PHOTOS = ("rocket.jpg", "chelsea.png", "coffee.png", "astronaut.png")
ROW_FILES = ("train.jsonl", "val.jsonl", "rejected.jsonl", "labels.json", "wds/train.rows.npy", "wds/val.rows.npy")


def _pictures() -> list[bytes]:
    import skimage

    out = []
    for name in PHOTOS:
        im = Image.open(Path(skimage.data_dir) / name).convert("RGB").resize((64, 48))
        buf = io.BytesIO()
        im.save(buf, "JPEG")
        out.append(buf.getvalue())
    return out


def _write_shard(path: Path, pictures: list[bytes], tag: str, extra: int = 0) -> None:
    """A shard of each picture with a caption and label, one cut-short picture, and ``extra`` more samples."""
    with wds.TarWriter(str(path)) as w:
        for j in range(len(pictures) + extra):
            pic = pictures[j % len(pictures)]
            w.write({"__key__": f"{tag}{j:04d}", "jpg": pic, "txt": f"{tag} picture {j}", "cls": str(j % 3)})
        w.write({"__key__": f"{tag}cut", "jpg": pictures[0][:300], "txt": "cut short", "cls": "0"})


@pytest.fixture
def folder(tmp_path) -> Path:
    pictures, folder = _pictures(), tmp_path / "shards"
    folder.mkdir()
    for k in range(3):
        _write_shard(folder / f"{k:05d}.tar", pictures, f"s{k}")
    return folder


def _recorded(out: Path) -> dict[str, dict]:
    """{shard name: its record} of a prepared folder."""
    return {Path(r["file"]).name: r for r in load_all(out)}


def _prepare(folder: Path, out: Path, minilm_dir: str, **kw) -> dict:
    cfg = PrepareConfig(
        source=str(folder),
        out=str(out),
        tokenizer=minilm_dir,
        max_length=16,
        progress=False,
        workers=1,  # shards read in this process, where the test counts them
        val_fraction=0.25,
        **({"inputs": InputOptions()} | kw),
    )
    return prepare_dataset(cfg)


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The shards ``read_shard`` opens from now on, by name."""
    seen: list[str] = []
    real = wds_input.read_shard

    def counted(shard, *args, **kwargs):
        seen.append(Path(shard).name)
        return real(shard, *args, **kwargs)

    monkeypatch.setattr(wds_input, "read_shard", counted)
    return seen


def test_an_edited_shard_is_read_again_and_the_others_are_not(tmp_path, folder, minilm_dir, reads, caplog):
    out = tmp_path / "prepared"
    _prepare(folder, out, minilm_dir)
    assert sorted(reads) == ["00000.tar", "00001.tar", "00002.tar"]
    assert sorted(_recorded(out)) == sorted(reads)
    _write_shard(folder / "00001.tar", _pictures(), "s1", extra=2)  # two samples more in shard 1
    reads.clear()
    with caplog.at_level("INFO", logger="mmfast.inputs.wds"):
        summary = _prepare(folder, out, minilm_dir)
    assert reads == ["00001.tar"]
    assert "2 of 3 shards unchanged since last read" in caplog.text
    assert summary["reused_checks"] == 2 * (len(PHOTOS) + 1)  # shards 0 and 2: their rows and rejects
    assert "reused_checks_from" not in summary  # from --out itself
    assert summary["counts"]["input_rows"] == 3 * (len(PHOTOS) + 1) + 2
    fresh = tmp_path / "fresh"
    _prepare(folder, fresh, minilm_dir)
    for name in ROW_FILES:  # the same rows, rejects, split and index as a preparation that read everything
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name


def test_other_options_or_a_damaged_record_read_every_shard(tmp_path, folder, minilm_dir, reads):
    out = tmp_path / "prepared"
    _prepare(folder, out, minilm_dir)
    reads.clear()
    tar = folder / "00000.tar"
    os.utime(tar, ns=(tar.stat().st_atime_ns, tar.stat().st_mtime_ns + 10**9))  # the same size, another mtime
    _prepare(folder, out, minilm_dir)
    assert reads == ["00000.tar"]
    reads.clear()
    _prepare(folder, out, minilm_dir, inputs=InputOptions(no_labels=True))  # another reading of the samples
    assert sorted(reads) == ["00000.tar", "00001.tar", "00002.tar"]
    assert all(r["label"] == NO_LABEL for r in _recorded(out)["00000.tar"]["rows"])
    reads.clear()
    _prepare(folder, out, minilm_dir, max_pixels=64 * 48)  # another pixel budget, at the pictures' size
    assert sorted(reads) == ["00000.tar", "00001.tar", "00002.tar"]
    reads.clear()
    for record in (out / FILE_READS).glob("*.json"):
        record.write_text('{"file": "' + str(folder / "00000.tar") + '", "rows": [')  # cut short
    tar = folder / "00002.tar"
    os.utime(tar, ns=(tar.stat().st_atime_ns, tar.stat().st_mtime_ns + 10**9))  # touched: prepared again
    summary = _prepare(folder, out, minilm_dir, max_pixels=64 * 48)
    assert sorted(reads) == ["00000.tar", "00001.tar", "00002.tar"] and summary["reused_checks"] == 0
    records = [json.loads(p.read_text()) for p in (out / FILE_READS).glob("*.json")]
    assert len(records) == 3 and all(r["key"]["max_pixels"] == 64 * 48 for r in records)


def test_a_record_keeps_any_file_name_and_refuses_rows_edited_by_hand(tmp_path):
    """A shard name that is not UTF-8 (as glob gives it: surrogate escapes) is recorded and found again; a record
    whose rows no longer hold what the index reads is not reused."""
    shard = tmp_path / os.fsdecode(b"caf\xe9.tar")
    cand = file_reads.Candidate(
        3, f"{shard}:k.jpg", "a cat", 1, {"shard": "x", "member": "k.jpg"}, width=4, height=3
    )
    rec = file_reads.record(shard, [10, 20], {"max_pixels": 9}, shard.name, ([cand], []))
    file_reads.write(tmp_path, [rec])
    found = file_reads.load([tmp_path], [shard])[str(shard)]
    assert file_reads.reusable(found[0], [10, 20], shard.name, {"max_pixels": 9}) == ([cand], [])
    assert file_reads.reusable(found[0], [10, 21], shard.name, {"max_pixels": 9}) is None  # another mtime
    # the same file reached through another source (its folder's parent given): its rows would name it otherwise
    assert file_reads.reusable(found[0], [10, 20], f"sub/{shard.name}", {"max_pixels": 9}) is None
    found[0]["rows"][0]["source"] = "k.jpg"
    assert file_reads.reusable(found[0], [10, 20], shard.name, {"max_pixels": 9}) is None


def test_parts_reuse_the_merged_records_and_pass_theirs_on(tmp_path, folder, minilm_dir, reads, monkeypatch):
    out = tmp_path / "prepared"
    for i in range(2):
        _prepare(folder, out, minilm_dir, shard=(i, 2))
    _prepare(folder, out, minilm_dir, merge=True)
    assert sorted(_recorded(out)) == ["00000.tar", "00001.tar", "00002.tar"]
    _write_shard(folder / "00002.tar", _pictures(), "s2", extra=1)
    reads.clear()
    opened: list[list[str]] = []
    real = file_reads.read_json_object
    monkeypatch.setattr(file_reads, "read_json_object", lambda p: opened[-1].append(Path(p).name) or real(p))
    for i in range(2):
        opened.append([])
        _prepare(folder, out, minilm_dir, shard=(i, 2))
    assert reads == ["00002.tar"]  # part 0 holds shard 0, part 1 shards 1 and 2
    assert set(opened[0]) == {file_reads._name(folder.resolve() / "00000.tar")}  # only its own shard's record
    assert len(set(opened[1])) == 2
    assert json.loads((part_dir(out, 1, 2) / "part.json").read_text())["reused_checks"] == len(PHOTOS) + 1
    summary = _prepare(folder, out, minilm_dir, merge=True)
    assert summary["counts"]["input_rows"] == 3 * (len(PHOTOS) + 1) + 1


def test_a_shard_read_only_in_part_is_read_again(tmp_path, folder, minilm_dir, reads):
    """A shard whose reading stopped early (cut short here; on a network filesystem an error that may pass) keeps
    no record: the next preparation reads it again instead of keeping its first samples for ever."""
    whole = (folder / "00001.tar").read_bytes()
    (folder / "00001.tar").write_bytes(whole[: len(whole) // 2])
    out = tmp_path / "prepared"
    summary = _prepare(folder, out, minilm_dir)
    assert summary["rejected_by_reason"].get("shard unreadable after", 0) or any(
        "shard unreadable" in line for line in (out / "rejected.jsonl").read_text().splitlines()
    )
    assert sorted(_recorded(out)) == ["00000.tar", "00002.tar"]
    (folder / "00001.tar").write_bytes(whole)  # the file whole again: same name, another size
    os.utime(folder / "00002.tar", ns=(1, 2 * 10**9))  # and another shard touched, so the input changed
    reads.clear()
    summary = _prepare(folder, out, minilm_dir)
    assert sorted(reads) == ["00001.tar", "00002.tar"]
    assert summary["counts"]["input_rows"] == 3 * (len(PHOTOS) + 1)


def test_a_merge_links_the_parts_records_without_reading_them(tmp_path, folder, minilm_dir, monkeypatch):
    """At millions of rows the records are about the size of the rows: the merge carries the parts' files over
    as they are (a damaged one is refused when a later preparation reads it, as any record is)."""
    out = tmp_path / "prepared"
    for i in range(2):
        _prepare(folder, out, minilm_dir, shard=(i, 2))
    parts = {p.name: p.read_bytes() for i in range(2) for p in (part_dir(out, i, 2) / FILE_READS).glob("*.json")}
    opened: list[Path] = []
    real = file_reads.read_json_object
    monkeypatch.setattr(file_reads, "read_json_object", lambda p: opened.append(p) or real(p))
    _prepare(folder, out, minilm_dir, merge=True)
    assert opened == []
    merged = {p.name: p.read_bytes() for p in (out / FILE_READS).glob("*.json")}
    assert merged == parts and len(merged) == 3
